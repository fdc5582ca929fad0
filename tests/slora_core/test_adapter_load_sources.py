"""Engine stats say where each adapter load into arena pages came from: the host tier or disk."""

from __future__ import annotations

from pathlib import Path

from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine
from slora_core.sampling_params import SamplingParams


def _serve(engine: LLMEngine, adapter: str, rid: str) -> None:
    engine.add_request(rid, [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=2,
                                                      ignore_eos=True), adapter=adapter)
    while engine.has_unfinished():
        engine.step()


def test_loads_counted_by_source(demo_dir: Path) -> None:
    adapter_dir = sorted((demo_dir / "adapters").iterdir())[0]
    # A host tier of 1 byte keeps only the most recently read adapter.
    engine = LLMEngine.from_model_dir(demo_dir / "model",
                                      EngineConfig(num_pages=64, host_cache_bytes=1))
    engine.register_adapter("x", adapter_dir, preload=False)
    engine.register_adapter("y", adapter_dir, preload=False)
    _serve(engine, "x", "1")  # read at admission, still in the host tier when copied
    st = engine.stats
    assert (st.adapter_loads, st.adapter_host_hits, st.adapter_disk_loads) == (1, 1, 0)
    engine.add_request("2", [5], SamplingParams(max_new_tokens=1), adapter="y")
    engine.unregister_adapter("y")  # gone from the host tier before its pages are filled
    engine.register_adapter("y", adapter_dir, preload=False)
    while engine.has_unfinished():
        engine.step()
    assert (st.adapter_loads, st.adapter_host_hits, st.adapter_disk_loads) == (2, 1, 1)
    assert engine.adapters.loads == 3  # x and y at admission, y again at its load
