"""The front's start-up report: the core's phases around its own, exported as Prometheus
gauges, graphs captured after ready added as they come (no processes: the messages the core
sends, built by hand)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.worker import core_protocol as m
from services.worker.startup import StartupReport, open_compile_cache
from slora_core.startup_profile import PhaseRecord


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_report_exports_phases_and_background_graphs() -> None:
    registry = CollectorRegistry()
    report = StartupReport(registry, started=time.time() - 5.0)
    report.phase_done("process", time.time() - 1.0)
    core = [PhaseRecord("core_spawn", 1.5), PhaseRecord("weights", 2.0, compiled=0),
            PhaseRecord("arena", 0.25),
            PhaseRecord("warmup", 0.5, compiled=3, cache_hits=4, compile_s=0.3)]
    report.ready(m.Ready(8, 512, [1], startup=core, compile_cache="/c/x (warm)",
                         graphs_pending=3), server_since=time.time() - 0.1)
    seconds = "slora_worker_startup_seconds"
    assert value(registry, seconds, phase="weights") == 2.0
    assert value(registry, seconds, phase="warmup") == 0.5
    assert 0.9 < (value(registry, seconds, phase="process") or 0) < 1.5
    assert 0.05 < (value(registry, seconds, phase="server") or 0) < 0.5
    assert 4.9 < (value(registry, seconds, phase="ready") or 0) < 6.0
    assert value(registry, seconds, phase="graph_capture") is None
    assert value(registry, "slora_worker_startup_graphs_pending") == 3
    assert value(registry, "slora_worker_startup_kernels", result="compiled") == 3
    assert value(registry, "slora_worker_startup_kernels", result="cache_hit") == 4

    # Three graphs captured while serving: two tile lists of one bucket add up.
    report.update(m.StartupUpdate([PhaseRecord("graph_capture", 0.5, compiled=2, compile_s=0.4,
                                               graphs="decode+lora", bucket=64,
                                               background=True)], 2))
    report.update(m.StartupUpdate([PhaseRecord("graph_capture", 0.25, graphs="decode+lora",
                                               bucket=64, background=True)], 1))
    assert value(registry, "slora_worker_startup_graphs_pending") == 1
    report.update(m.StartupUpdate([PhaseRecord("graph_capture", 0.125, graphs="mixed",
                                               bucket=512, background=True)], 0))
    assert value(registry, "slora_worker_startup_graphs_pending") == 0
    assert value(registry, seconds, phase="graph_capture") == 0.875
    assert value(registry, "slora_worker_startup_graph_seconds",
                 graphs="decode+lora", bucket="64") == 0.75
    assert value(registry, "slora_worker_startup_graph_seconds", graphs="mixed",
                 bucket="512") == 0.125
    assert value(registry, "slora_worker_startup_kernels", result="compiled") == 5
    # Ready time is the process's, not moved by work done after it.
    assert 4.9 < (value(registry, seconds, phase="ready") or 0) < 6.0
    assert report.profile.total_s() < report.profile.total_s(background=True)


def test_ready_and_update_messages_cross_the_socket_encoding() -> None:
    rec = PhaseRecord("graph_capture", 0.5, 1, 2, 0.25, "decode", 8, True)
    for msg in (m.Ready(1, 2, [3], [rec], "c", 4), m.StartupUpdate([rec], 0)):
        assert m.from_core_decoder.decode(m.encoder.encode(msg)) == msg


def test_an_unusable_cache_root_is_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A root that cannot be created (a file in the way, as a read-only layer would refuse
    it): no cache, a warning, Triton's default cache left alone; a usable root activates."""
    from triton import knobs

    from slora_core.config import EngineConfig

    monkeypatch.setattr(knobs.compilation, "listener", None)  # put back after the test

    blocker = tmp_path / "file"
    blocker.write_text("")
    before = os.environ.get("TRITON_CACHE_DIR")
    with caplog.at_level(logging.WARNING):
        cache, stats = open_compile_cache(blocker / "compiled", EngineConfig())
    assert cache is None and stats.compiled == 0 and "unusable" in caplog.text
    assert os.environ.get("TRITON_CACHE_DIR") == before
    try:
        cache, _ = open_compile_cache(tmp_path / "compiled", EngineConfig())
        assert cache is not None and cache.state == "cold"
        assert os.environ["TRITON_CACHE_DIR"] == str(cache.triton_dir)
    finally:
        if before is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = before
