"""The front's start-up report: the core's phases around its own, exported as Prometheus
gauges, graphs captured after ready added as they come (no processes: the messages the core
sends, built by hand)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from services.worker import core_protocol as m
from services.worker.startup import StartupReport
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
