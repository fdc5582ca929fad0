"""The compiled-kernel cache: one folder per key, a stale or foreign entry never used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from slora_core.compile_cache import (
    KEEP_OTHER_KEYS,
    KEEP_WARMUPS,
    TRITON_SUBDIR,
    CacheKey,
    CompileCache,
    CompileStats,
    current_key,
    kernel_source_digest,
    warmup_digest,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = CacheKey(device="NVIDIA H200 sm_90", driver="570.86.15 cuda-api 12080", cuda="12.8",
               triton="3.9.0", torch="2.13.0", python="3.11.9", kernels="a" * 64)


def plant(cache: CompileCache, name: str = "KERNELHASH") -> Path:
    """A binary in the cache's Triton folder, as Triton would leave it."""
    entry = cache.triton_dir / name / "kernel.cubin"
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"binary")
    return entry


@pytest.mark.parametrize("field,value", [
    ("device", "NVIDIA A100-SXM4-80GB sm_80"), ("driver", "550.54.15 cuda-api 12040"),
    ("cuda", "12.4"), ("triton", "3.8.0"), ("torch", "2.12.0"), ("python", "3.12.1"),
    ("kernels", "b" * 64),
])
def test_every_key_field_picks_its_own_folder(tmp_path: Path, field: str, value: str) -> None:
    first = CompileCache.open(tmp_path, key=KEY)
    entry = plant(first)
    other = CompileCache.open(tmp_path, key=replace(KEY, **{field: value}))  # type: ignore[arg-type]
    assert other.path != first.path and other.state == "cold"
    assert not any(other.path.rglob("*.cubin"))
    # The first key's binaries are still there for a roll back, and found again.
    assert entry.exists()
    again = CompileCache.open(tmp_path, key=KEY)
    assert again.state == "warm" and again.path == first.path and entry.exists()


def test_kernel_source_change_changes_the_digest(tmp_path: Path) -> None:
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    before = kernel_source_digest(src)
    assert kernel_source_digest(src) == before
    (src / "a.py").write_text("x = 2\n")
    changed = kernel_source_digest(src)
    (src / "a.py").write_text("x = 1\n")
    (src / "b.py").write_text("")  # a new file counts too
    assert len({before, changed, kernel_source_digest(src)}) == 3


def test_current_key_on_cpu_uses_this_process() -> None:
    import torch
    import triton

    key = current_key("cpu")
    assert key.device == "cpu" and key.triton == triton.__version__
    assert key.torch == torch.__version__ and key.kernels == kernel_source_digest()


@pytest.mark.parametrize("manifest", [
    "{not json", "[]", json.dumps({"digest": "x"}),
    json.dumps({"key": {"device": "cpu"}, "digest": "x"}),
])
def test_unreadable_manifest_empties_the_folder(tmp_path: Path, manifest: str) -> None:
    cache = CompileCache.open(tmp_path, key=KEY)
    entry = plant(cache)
    cache.manifest_path.write_text(manifest)
    reopened = CompileCache.open(tmp_path, key=KEY)
    assert reopened.state.startswith("rebuilt"), reopened.state
    assert not entry.exists()
    assert reopened.manifest()["digest"] == KEY.digest()  # rebuilt: trusted from now on
    assert CompileCache.open(tmp_path, key=KEY).state == "warm"


def test_foreign_folder_is_emptied(tmp_path: Path) -> None:
    """A folder copied in from another key (another GPU's cache renamed, a digest clash)."""
    foreign = CompileCache.open(tmp_path / "elsewhere", key=replace(KEY, device="other sm_80"))
    plant(foreign)
    foreign.path.rename(CompileCache(tmp_path, KEY).path)
    reopened = CompileCache.open(tmp_path, key=KEY)
    assert reopened.state == "rebuilt: manifest of another key"
    assert not any(reopened.path.rglob("*.cubin"))


def test_folder_without_manifest_is_not_trusted(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, KEY)
    entry = plant(cache)  # e.g. a start killed before it wrote its manifest
    assert CompileCache.open(tmp_path, key=KEY).state == "rebuilt: no manifest"
    assert not entry.exists()


def test_manifest_counts_starts_and_records_facts(tmp_path: Path) -> None:
    CompileCache.open(tmp_path, key=KEY)
    cache = CompileCache.open(tmp_path, key=KEY)
    cache.record(compiled=3, cache_hits=0)
    m = cache.manifest()
    assert m["starts"] == 2 and m["last_start"] == {"compiled": 3, "cache_hits": 0}
    assert CacheKey.from_dict(m["key"]) == KEY


def test_a_warmup_is_held_once_noted_and_forgotten_with_the_folder(tmp_path: Path) -> None:
    cache = CompileCache.open(tmp_path, key=KEY)
    assert not cache.holds("w1")
    cache.note_warmup("w1")
    cache.record(compiled=0, cache_hits=5)  # later facts keep the note
    reopened = CompileCache.open(tmp_path, key=KEY)
    assert reopened.holds("w1") and not reopened.holds("w2")
    for i in range(KEEP_WARMUPS):  # the oldest notes go first
        reopened.note_warmup(f"x{i}")
    assert not reopened.holds("w1") and reopened.holds(f"x{KEEP_WARMUPS - 1}")
    reopened.manifest_path.write_text("{not json")  # a folder not trusted forgets its notes
    assert not CompileCache.open(tmp_path, key=KEY).holds(f"x{KEEP_WARMUPS - 1}")


def test_warmup_digest_follows_every_setting() -> None:
    from slora_core.config import EngineConfig

    base = warmup_digest("model", EngineConfig())
    assert base == warmup_digest("model", EngineConfig())
    assert base != warmup_digest("model", EngineConfig(max_num_seqs=32))
    assert base != warmup_digest("other model", EngineConfig())


def test_old_keys_are_pruned(tmp_path: Path) -> None:
    paths = [CompileCache.open(tmp_path, key=replace(KEY, kernels=str(i))).path
             for i in range(KEEP_OTHER_KEYS + 3)]
    kept = [p for p in paths if p.exists()]
    # The newest key and the KEEP_OTHER_KEYS used before it.
    assert kept == paths[-(KEEP_OTHER_KEYS + 1):]


def test_compile_stats_add_up_triton_reports() -> None:
    """Triton's listener reports microseconds per stage; a hit only the look-up."""
    miss = SimpleNamespace(ir_initialization=1000, lowering_stages=[("ttir", 2000),
                                                                    ("cubin", 3000)],
                           store_results=500)
    hit = SimpleNamespace(ir_initialization=100, lowering_stages=[], store_results=0)
    stats = CompileStats(compiled=4)
    before = stats.snapshot()
    for times, cache_hit in ((miss, False), (hit, True), (hit, True)):
        stats(src=None, metadata={}, metadata_group={}, times=times, cache_hit=cache_hit)
    done = stats.since(before)
    assert (done.compiled, done.cache_hits) == (1, 2)
    assert done.compile_s == pytest.approx(0.0065) and done.load_s == pytest.approx(0.0002)


def test_activate_points_triton_at_the_folder(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cache = CompileCache.open(tmp_path, key=KEY)
    cache.activate()
    assert knobs.cache.dir == str(tmp_path / cache.path.name / TRITON_SUBDIR)
    assert os.environ["TRITON_CACHE_DIR"] == knobs.cache.dir


# Run in a child, from a file (Triton reads a kernel's source): kernels compile only when
# decorated with TRITON_INTERPRET=0 (the suite's conftest sets 1 for the interpreter).
CHILD = """
import json, sys
from dataclasses import replace
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slora_core.compile_cache import CacheKey, CompileCache, CompileStats

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

src = ASTSource(fn=add_one, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                constexprs={(2,): 64})
key = CacheKey(**json.loads(sys.argv[2]))
stats = CompileStats()
stats.install()
out = []
for change in json.loads(sys.argv[3]):
    CompileCache.open(Path(sys.argv[1]), key=replace(key, **change)).activate()
    before = stats.snapshot()
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
    done = stats.since(before)
    out.append([done.compiled, done.cache_hits])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_binary_of_another_key_is_never_loaded(tmp_path: Path) -> None:
    """Triton compiles a kernel for sm_90 (ahead of time: no GPU needed) into the active
    folder; the same key finds it again (a hit), a key with other kernel sources or another
    Triton compiles afresh, and the first key still finds its own binary."""
    changes = [{}, {}, {"kernels": "c" * 64}, {"triton": "3.10.0"}, {}]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_CACHE_DIR", None)
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    done = subprocess.run([sys.executable, str(child), str(tmp_path / "cache"),
                           json.dumps(asdict(KEY)),
                           json.dumps(changes)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled_hits = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled_hits == [[1, 0], [0, 1], [1, 0], [1, 0], [0, 1]]
