"""Where each adapter load comes from (the host tier, a disk read in the step, a disk read in the
background), and adapters read from disk off the step loop: running requests keep stepping
while a waiting request's adapter is read, a bad file fails only its requests."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.outputs import ADAPTER_UNLOADABLE, RequestOutput
from slora_core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)


def _serve(engine: LLMEngine, adapter: str, rid: str) -> None:
    engine.add_request(rid, [5, 6, 7], GREEDY, adapter=adapter)
    while engine.has_unfinished():
        engine.step()


def _wait_cached(engine: LLMEngine, name: str) -> None:
    deadline = time.monotonic() + 30
    while not engine.adapters.is_cached(name):
        assert time.monotonic() < deadline, f"{name} never reached the host tier"
        time.sleep(0.01)


def test_loads_counted_by_source(demo_dir: Path) -> None:
    # Three adapters of other content (the engine knows adapters by their digest).
    x_dir, y_dir, z_dir = sorted((demo_dir / "adapters").iterdir())[:3]
    # A host tier of 1 byte keeps only the most recently read adapter.
    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(num_pages=64, host_cache_bytes=1))
    engine.register_adapter("x", x_dir, preload=False)
    engine.register_adapter("y", y_dir, preload=False)
    engine.register_adapter("z", z_dir, preload=False)
    _serve(engine, "x", "1")  # read in the background, still in the host tier when copied
    st = engine.stats
    assert (st.adapter_loads, st.adapter_host_hits, st.adapter_disk_loads,
            st.adapter_background_reads) == (1, 1, 0, 1)
    engine.add_request("2", [5], SamplingParams(max_new_tokens=1), adapter="y")
    _wait_cached(engine, "y")
    engine.load_adapter("z")  # y leaves the host tier before its pages are filled
    while engine.has_unfinished():
        engine.step()
    assert (st.adapter_loads, st.adapter_host_hits, st.adapter_disk_loads,
            st.adapter_background_reads) == (2, 1, 1, 2)
    assert engine.adapters.loads == 4  # x, y in the background, z, y again in its step


def test_a_slow_disk_read_does_not_stall_running_requests(demo_dir: Path) -> None:
    names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(num_pages=64))
    engine.register_adapter("warm", demo_dir / "adapters" / names[0])
    engine.register_adapter("cold", demo_dir / "adapters" / names[1], preload=False)
    release = threading.Event()
    read = engine.adapters._load  # the disk read of a host-tier miss

    def slow_read(spec):  # type: ignore[no-untyped-def]
        assert release.wait(30), "the test never released the read"
        return read(spec)

    engine.adapters._load = slow_read  # type: ignore[method-assign]
    long = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    engine.add_request("running", [5, 6, 7], long, adapter="warm")
    engine.add_request("base", [8, 9], long)
    engine.add_request("waits", [5, 6, 7], GREEDY, adapter="cold")  # returns at once
    tokens: dict[str, list[int]] = {}
    for _ in range(6):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    # Six steps ran while the read was blocked: the others made progress, "waits" none.
    assert len(tokens["running"]) == 6 and len(tokens["base"]) == 6
    assert "waits" not in tokens and engine.num_waiting == 1
    release.set()
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert {r: o.finish_reason for r, o in finished.items()} == {
        "running": "length", "base": "length", "waits": "length"}
    # The same tokens as an engine that read the adapter before the request came.
    ref = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(num_pages=64))
    ref.register_adapter("cold", demo_dir / "adapters" / names[1])
    ref.add_request("waits", [5, 6, 7], GREEDY, adapter="cold")
    want: list[int] = []
    while ref.has_unfinished():
        for out in ref.step():
            want += out.token_ids
    assert tokens["waits"] == want


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_bad_file_read_in_the_background_fails_only_its_requests(
        demo_dir: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(sorted((demo_dir / "adapters").iterdir())[0], bad)
    weights = bad / "adapter_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(num_pages=64))
    # With its digest given (as the worker registers), nothing is read yet: registration
    # succeeds (without one the engine hashes the files at once, and that read would fail).
    engine.register_adapter("bad", bad, "0" * 64, preload=False)
    engine.add_request("b1", [5, 6], GREEDY, adapter="bad")
    engine.add_request("b2", [7], GREEDY, adapter="bad")
    engine.add_request("ok", [5, 6], GREEDY)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["ok"].finish_reason == "length" and finished["ok"].completion_tokens == 2
    for rid in ("b1", "b2"):
        out = finished[rid]
        assert (out.finish_reason, out.error_kind, out.completion_tokens) == (
            "error", ADAPTER_UNLOADABLE, 0)
        assert "adapter 'bad' could not be loaded" in out.error
    assert engine.pool.num_kv_pages == 0


def test_a_request_too_big_with_its_adapter_fails_when_the_adapter_is_read(
        demo_dir: Path) -> None:
    """The KV part is checked at add_request; the adapter's pages once it has been read."""
    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(num_pages=8, block_size=64, max_rank=64))
    engine.register_adapter("big", demo_dir / "adapters" / "all-r64", preload=False)
    params = SamplingParams(temperature=0, max_new_tokens=7 * 64 - 8, ignore_eos=True)
    engine.add_request("r", [5] * 8, params, adapter="big")  # 7 KV pages: fits alone
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finish_reason == "error"
    assert outs[0].error_kind == ADAPTER_UNLOADABLE
    assert "arena pages at its longest with its adapter, the arena has 8" in outs[0].error


def test_concurrent_reads_of_one_adapter_parse_it_once(demo_dir: Path) -> None:
    """The worker's load command and a request's background read ask for one new adapter at
    once: the second waits for the first's read; a different adapter is read beside them."""
    dirs = sorted((demo_dir / "adapters").iterdir())
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(num_pages=64))
    store = engine.adapters
    store.register("a", dirs[0])
    store.register("b", dirs[1])
    read, started, release = store._load, threading.Event(), threading.Event()

    def slow_read(spec):  # type: ignore[no-untyped-def]
        if spec.name == "a":
            started.set()
            assert release.wait(30)
        return read(spec)

    store._load = slow_read  # type: ignore[method-assign]
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(store.get("a"))) for _ in range(3)]
    threads[0].start()
    assert started.wait(30)
    for t in threads[1:]:
        t.start()
    assert store.get("b") is not None  # not held up by the read of "a"
    time.sleep(0.2)  # let the other two reach the read of "a" before it completes
    release.set()
    for t in threads:
        t.join(30)
    assert len(got) == 3 and got[0] is got[1] is got[2]
    assert store.loads == 2  # "a" once, "b" once
