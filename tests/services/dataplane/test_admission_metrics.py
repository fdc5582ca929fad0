"""Late admission's totals (slora_core/admission.py, on by default) reach the worker's
Prometheus metrics: the engine core puts its pacer's counts in each step's state, the front's
counters follow them (services/worker/main.py `publish_state`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker import core_protocol as m
from services.worker.engine_core import EngineCore
from services.worker.main import publish_state
from services.worker.metrics import WorkerMetrics
from slora_core.admission import AdmissionPacer
from slora_core.config import EngineConfig
from slora_core.engine import LLMEngine

FAMILIES = ("slora_admission_waits_total", "slora_admission_wait_seconds_total",
            "slora_admission_requests_taken_total", "slora_admission_paced_steps_total",
            "slora_admission_gpu_idle_seconds_total")


def totals(metrics: WorkerMetrics) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()) for s in f.samples if s.name in FAMILIES}


def test_the_pacers_counts_reach_the_workers_counters(demo_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_dir / "model", EngineConfig(
        num_pages=64, block_size=16, max_rank=16))
    core = EngineCore(engine, outputs=None, parent_pid=0)  # type: ignore[arg-type]
    assert engine.loop.pacer is None  # on the CPU nothing runs beside the host: no pacing
    unpaced = core._snapshot()
    pacer = engine.loop.pacer = AdmissionPacer(0.001)  # as a CUDA engine's loop has it
    pacer.took(0.004, 3)
    pacer.took(0.002, 0)
    pacer.idle(0.0003)
    pacer.idle(0.00001)  # the events' own noise: a paced step, no idle time
    first = core._snapshot()
    pacer.took(0.001, 2)
    second = core._snapshot()
    metrics = WorkerMetrics()
    seen = []
    for state in (unpaced, first, second):
        publish_state(metrics, m.StepOutput(rids=[], token_ids=[], logprobs=[], top=None,
                                            finished=[], started=[], state=state))
        seen.append(totals(metrics))
    assert seen[0] == dict.fromkeys(FAMILIES, 0.0)
    assert seen[1]["slora_admission_waits_total"] == 2
    assert seen[2] == pytest.approx({
        "slora_admission_waits_total": 3, "slora_admission_wait_seconds_total": 0.007,
        "slora_admission_requests_taken_total": 5, "slora_admission_paced_steps_total": 2,
        "slora_admission_gpu_idle_seconds_total": 0.0003})
    engine.close()


def test_a_total_that_starts_again_counts_on_and_fails_nothing() -> None:
    metrics = WorkerMetrics()
    metrics.advance(metrics.admission_waits, 5)
    metrics.advance(metrics.admission_waits, 2)  # a core whose counts began again
    metrics.advance(metrics.admission_waits, 3)
    assert totals(metrics)["slora_admission_waits_total"] == 8
