"""Shared fixtures: the seeded demo assets, and a paged-KV harness that drives our model one
engine step at a time through a hand-built StepContext (torch reference ops on CPU)."""

from __future__ import annotations

import os

# Kernel tests run the Triton kernels on the CPU interpreter unless TRITON_INTERPRET=0 is set
# (on a GPU machine). Triton reads the variable when a kernel is decorated, so it is set here,
# in the first conftest pytest loads: a test module collected before tests/kernels (tests/bench
# imports bench scripts that import `kernels`) would otherwise fix every kernel as compiled,
# and the CPU tests then fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
os.environ.setdefault("TRITON_INTERPRET", "1")

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from devtools.demo_assets import write_demo_assets
from slora_core.config import ModelConfig
from slora_core.context import StepContext, step_context
from slora_core.model import LlamaForCausalLM

KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"


def _dtype(item: pytest.Item) -> Any:
    return getattr(getattr(item, "callspec", None), "params", {}).get("dtype")


def _dtype_twin(item: pytest.Item) -> tuple[Any, ...]:
    """A parametrized case's identity less its dtype."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    rest = tuple(sorted((k, repr(v)) for k, v in params.items() if k != "dtype"))
    return (item.path, getattr(item, "originalname", item.name), rest)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the Triton interpreter a kernel case costs seconds, and each runs in float32 and
    float16 (tests/kernels/helpers.py DTYPES). The default run keeps the float16 case, the
    dtype GPUs serve; its float32 twin, the same kernel code at another width, is marked slow
    (`pytest -m slow` runs it). A case without a float16 twin stays in the default run.
    Also checks that the modules sharing a group's fixture are in its group (XDIST_GROUPS)."""
    kernels = [i for i in items if KERNEL_TESTS in i.path.parents]
    with_fp16 = {_dtype_twin(i) for i in kernels if _dtype(i) is torch.float16}
    for item in kernels:
        if _dtype(item) is torch.float32 and _dtype_twin(item) in with_fp16:
            item.add_marker(pytest.mark.slow)
    check_groups(config, items)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo assets (seed 0) generated once per session: model/, adapters/, manifest.json."""
    root = tmp_path_factory.mktemp("demo")
    write_demo_assets(root, seed=0)
    return root


class PagedKV:
    """A page arena in the DESIGN section 3 layout plus block tables for a few sequences.

    Pages are handed out in a shuffled order, so every block table is non-contiguous. The arena
    starts as NaN (float dtypes): reading a KV row that was never written poisons the output.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 num_pages: int = 64, block_size: int = 4, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        layers, kv_heads, head_dim = (config.num_hidden_layers, config.num_key_value_heads,
                                      config.head_dim)
        page_numel = block_size * layers * 2 * kv_heads * head_dim
        self.arena = torch.full((num_pages, page_numel), float("nan"), dtype=dtype,
                                device=self.device)
        pages = self.arena.view(num_pages, layers, 2, block_size, kv_heads, head_dim)
        self.kv_caches = tuple((pages[:, i, 0], pages[:, i, 1]) for i in range(layers))
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def build_context(self, chunks: dict[int, list[int]]) -> tuple[StepContext, torch.Tensor]:
        """Append chunks[seq] to each listed sequence; return the step's context and input ids."""
        ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        for seq, tokens in chunks.items():
            start = self.lens[seq]
            end = start + len(tokens)
            while len(self.tables[seq]) * self.block_size < end:
                self.tables[seq].append(self.free.pop())
            for pos in range(start, end):
                page = self.tables[seq][pos // self.block_size]
                slots.append(page * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
            tables.append(self.tables[seq])
            self.lens[seq] = end
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        ctx = StepContext(
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_starts=tensor(starts, torch.int32),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            logits_indices=torch.arange(len(ids), dtype=torch.int64, device=self.device),
            kv_caches=self.kv_caches,
        )
        return ctx, tensor(ids, torch.int64)

    @torch.no_grad()
    def step(self, model: LlamaForCausalLM, chunks: dict[int, list[int]]
             ) -> dict[int, torch.Tensor]:
        """Run one engine step; return each listed sequence's logits [len(chunk), vocab]."""
        ctx, ids = self.build_context(chunks)
        with step_context(ctx):
            hidden = model(ids, ctx.positions)
        logits = model.compute_logits(hidden[ctx.logits_indices])
        bounds = ctx.query_starts.tolist()
        return {seq: logits[bounds[i]:bounds[i + 1]] for i, seq in enumerate(chunks)}


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory: paged_kv(config, dtype=..., num_pages=..., block_size=..., seed=..., device=...)."""
    return PagedKV


# Small shapes that still exercise GQA (4 query heads over 2 KV heads) and a head_dim whose
# RoPE frequencies span all three llama3 bands.
_TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
    "max_position_embeddings": 256,
}


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    # HF's default init (std 0.02, zero biases, unit norms) would hide bias and norm bugs and
    # give near-uniform logits; unit-scale weights make every parameter matter.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen))


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """Factory: hf_checkpoint(model_type="llama", max_shard_size=None, seed=0, **config) saves a
    seeded random HF model (transformers' own classes) and returns (directory, HF model)."""

    def make(model_type: str = "llama", max_shard_size: str | None = None, seed: int = 0,
             **overrides: Any) -> tuple[Path, Any]:
        import transformers

        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[model_type]
        config = config_cls(**{**_TINY, **overrides})
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        _randomize_(model, seed)
        out = tmp_path / f"{model_type}-{seed}-{len(list(tmp_path.iterdir()))}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, **kwargs)
        return out, model

    return make


# ---- parallel runs (pytest-xdist) -----------------------------------------------------------
# pyproject's addopts run the suite on two xdist workers with `--dist loadfile`, which the
# scheduler below refines: a work unit is a test module, or a group of modules that share one
# session fixture (XDIST_GROUPS), so a module's or a group's stack starts once; and units are
# handed out longest first (UNIT_SECONDS: measured on the 2-core CI machine, one process;
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
UNIT_SECONDS = {
    "tests/test_static_checks.py": 85,  # mypy with a cold cache
    "tests/test_readme_examples.py": 80,
    "http_stack": 70,
    "tests/services/dataplane/test_stack_e2e.py": 62,
    "tests/kernels/test_sm90_compile.py": 50,
    "tests/services/dataplane/test_gateway_processes.py": 40,
    "tests/services/dataplane/test_http_errors.py": 40,
    "tests/slora_core/test_tensor_parallel.py": 40,
    "tests/slora_core/test_tp_keepalive.py": 37,
    "tests/services/dataplane/test_worker_faults.py": 37,
    "tests/slora_core/test_lora_merge.py": 35,
    "tests/services/security/test_tls.py": 32,
    "tests/services/dataplane/test_rollout_e2e.py": 30,
    "tests/services/dataplane/test_worker_process.py": 27,
    "tests/services/dataplane/test_adapter_manager.py": 23,
    "tests/services/dataplane/test_tensor_parallel_core.py": 20,
    "tests/slora_core/test_process.py": 16,
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
