"""Shared fixtures: the seeded demo assets, a paged-KV harness that drives our model one engine
step at a time through a hand-built StepContext (torch reference ops on CPU) and seeded random
HF checkpoints (both in tests/model_support.py); the xdist scheduler of parallel runs. Torch is
imported where a fixture or the collection needs it: the xdist controller runs no test."""

from __future__ import annotations

import os

# Kernel tests run the Triton kernels on the CPU interpreter unless TRITON_INTERPRET=0 is set
# (on a GPU machine). Triton reads the variable when a kernel is decorated, so it is set here,
# in the first conftest pytest loads: a test module collected before tests/kernel_tests (tests/bench
# imports bench scripts that import `kernels`) would otherwise fix every kernel as compiled,
# and the CPU tests then fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.model_support import PagedKV

KERNEL_TESTS = Path(__file__).resolve().parent / "kernel_tests"


def _dtype(item: pytest.Item) -> Any:
    return getattr(getattr(item, "callspec", None), "params", {}).get("dtype")


def _dtype_twin(item: pytest.Item) -> tuple[Any, ...]:
    """A parametrized case's identity less its dtype."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    rest = tuple(sorted((k, repr(v)) for k, v in params.items() if k != "dtype"))
    return (item.path, getattr(item, "originalname", item.name), rest)


def mark_by_need(item: pytest.Item) -> None:
    """The markers a test's needs imply, so `-m` selects by them: `gpu` and `docker` (a skipif
    whose reason names CUDA or the GPU, or docker) and `postgres` (a case parametrized with the
    "postgresql" backend)."""
    reasons = " ".join(str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
    if "CUDA" in reasons or "GPU" in reasons:
        item.add_marker(pytest.mark.gpu)
    if "docker" in reasons:
        item.add_marker(pytest.mark.docker)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "postgresql" in [v for v in params.values() if isinstance(v, str)]:
        item.add_marker(pytest.mark.postgres)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the Triton interpreter a kernel case costs seconds, and each runs in float32 and
    float16 (tests/kernel_tests/helpers.py DTYPES). The default run keeps the float16 case, the
    dtype GPUs serve; its float32 twin, the same kernel code at another width, is marked slow
    (`pytest -m slow` runs it). A case without a float16 twin stays in the default run.
    Also checks that the modules sharing a group's fixture are in its group (XDIST_GROUPS)."""
    import torch

    for item in items:
        mark_by_need(item)
    kernels = [i for i in items if KERNEL_TESTS in i.path.parents]
    with_fp16 = {_dtype_twin(i) for i in kernels if _dtype(i) is torch.float16}
    for item in kernels:
        if _dtype(item) is torch.float32 and _dtype_twin(item) in with_fp16:
            item.add_marker(pytest.mark.slow)
    check_groups(config, items)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo assets (seed 0) generated once per run: model/, adapters/, manifest.json. The
    xdist workers of a run share one copy (in the folder above each worker's own temp folder,
    written by the first to need it, ~6 s); tests only read it."""
    import fcntl

    from devtools.demo_assets import write_demo_assets

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "demo-assets"
    with open(shared / "demo-assets.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "manifest.json").exists():
            partial = shared / "demo-assets.partial"
            write_demo_assets(partial, seed=0)
            partial.rename(root)
    return root


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory: paged_kv(config, dtype=..., num_pages=..., block_size=..., seed=..., device=...)."""
    from tests.model_support import PagedKV

    return PagedKV


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """Factory: hf_checkpoint(model_type="llama", max_shard_size=None, seed=0, **config) saves a
    seeded random HF model (transformers' own classes) and returns (directory, HF model)."""
    from tests.model_support import save_hf_checkpoint

    def make(model_type: str = "llama", max_shard_size: str | None = None, seed: int = 0,
             **overrides: Any) -> tuple[Path, Any]:
        return save_hf_checkpoint(tmp_path, model_type, max_shard_size, seed, **overrides)

    return make


# ---- parallel runs (pytest-xdist) -----------------------------------------------------------
# pyproject's addopts run the suite on two xdist workers with `--dist loadfile`, which the
# scheduler below refines: a work unit is a test module, or a group of modules that share one
# session fixture (XDIST_GROUPS), so a module's or a group's stack starts once; and units are
# handed out longest first (UNIT_SECONDS: seconds on the 2-core CI machine in a 2-worker run;
# unknown modules count half a second a test), so no long module is left to run alone at the
# end. The seconds only order the work: a stale number costs time, not results.
# (xdist's own xdist_group marker does not group under pytest 9: it rewrites a nodeid that
# pytest 9 computes.)
XDIST_GROUPS = {
    # tests/services/conftest.py's shared_http_stack
    "tests/services/dataplane/test_http_api.py": "http_stack",
    "tests/services/dataplane/test_structured_http.py": "http_stack",
    "tests/services/security/test_stack_hops.py": "http_stack",
}
UNIT_SECONDS = {  # a second run in a fresh clone of 08018eb (the static checks: its first)
    "tests/test_readme_examples.py": 64,
    "tests/test_static_checks.py": 58,  # mypy with a cold cache (a fresh clone)
    "tests/kernel_tests/test_lora.py": 50,
    "tests/services/dataplane/test_stack_e2e.py": 48,
    "tests/slora_core/test_tp_keepalive.py": 45,  # sleeps mostly
    "http_stack": 45,
    "tests/services/dataplane/test_gateway_processes.py": 39,
    "tests/kernel_tests/test_sm90_compile.py": 27,
    "tests/slora_core/test_mixed_graph_tiles.py": 26,  # the step on Triton's interpreter
    "tests/kernel_tests/test_lora_variants.py": 23,
    "tests/services/dataplane/test_worker_process.py": 22,
    "tests/slora_core/test_tensor_parallel.py": 21,
    "tests/services/dataplane/test_rollout_e2e.py": 21,
    "tests/services/dataplane/test_http_errors.py": 19,
    "tests/services/security/test_tls.py": 17,
    "tests/test_markers.py": 17,
    "tests/bench/test_distinct_profile.py": 17,  # the profile scenario on the tiny shape
    "tests/kernel_tests/test_graph_tile_lists.py": 16,
    "tests/services/dataplane/test_gateway_mux.py": 15,
    "tests/services/dataplane/test_worker_faults.py": 15,
    "tests/slora_core/test_lora_ride.py": 13,  # fused ride steps on Triton's interpreter
    "tests/services/dataplane/test_adapter_manager.py": 12,
    "tests/bench/test_distinct_checkpoint.py": 12,
    "tests/services/control_plane/test_registry_concurrency.py": 11,
    "tests/kernel_tests/test_paged_attention.py": 11,
    "tests/services/dataplane/test_tensor_parallel_core.py": 10,
    "tests/slora_core/test_process.py": 9,
    "tests/services/control_plane/test_admin_cli.py": 8,
    "tests/slora_core/test_lora_merge.py": 8,
    "tests/bench/test_front_burst.py": 8,
    "tests/services/control_plane/test_registry_s3.py": 8,
    "tests/kernel_tests/test_ride_expand.py": 8,
    "tests/test_packaging.py": 7,
    "tests/slora_core/test_structured_engine.py": 7,
    "tests/test_readme_table.py": 4,
}


# A session fixture a group shares: a module that uses it and is not in the group would start
# the fixture again on whichever worker runs it (collection fails, naming the module).
GROUP_FIXTURES = {"shared_http_stack": "http_stack"}


def check_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.relative_to(config.rootpath).as_posix()
        for fixture, group in GROUP_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()) and XDIST_GROUPS.get(module) != group:
                raise pytest.UsageError(f"{module} uses {fixture}: add it to XDIST_GROUPS as "
                                        f"{group!r} (tests/conftest.py)")


def xdist_unit(module: str) -> str:
    """The work unit of a module's tests: its group, else the module (a path from the root)."""
    return XDIST_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node: Any) -> None:
            scope = max(self.workqueue, key=lambda s: UNIT_SECONDS.get(
                s, 0.5 * len(self.workqueue[s])))
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid)
                                    for nodeid, done in work_unit.items() if not done])

    return LongestFirst(config, log)
