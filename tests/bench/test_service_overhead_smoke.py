"""bench.service_overhead runs end to end on the CPU at the tiny shape: a real stack, every path
(in-process, worker, gateway gRPC over its multiplexed worker stream and over one worker call a
request, HTTP read by httpx and by aiohttp) under open-loop arrivals,
each request's TTFT from its own send beside the old from-the-run's-start figure. (The closed
loop is what the GPU suite `service-path` runs.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from slora_core.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
# The default gateway makes one worker call a request; gateway_mux is a second gateway
# multiplexing its worker calls over one GenerateMux stream (--also-upstream mux).
PATHS = {"worker", "gateway", "gateway_mux", "http", "http_aiohttp"}


@pytest.mark.slow
def test_an_open_loop_level_covers_every_path(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.service_overhead", "--concurrency", "4", "--rates", "6",
         "--open-loop-s", "1", "--repeats", "1", "--new-tokens", "4", "--client-procs", "1",
         "--http", "--http-clients", "httpx,aiohttp", "--also-upstream", "mux",
         "--trace-hops", str(tmp_path / "hops"),
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"commit", "command", "hardware", "targets"} <= set(result)
    (level,) = result["levels"]
    assert level["rate"] == 6 and level["requests"] == 6
    assert set(level["ratios"]) == PATHS
    for path, runs in level["runs"].items():
        (run,) = runs
        assert run["errors"] == [], (path, run["errors"])
        assert run["output_tokens"] == 6 * 4, path
        assert math.isfinite(run["request_ttft_p50_s"]) and run["request_ttft_p50_s"] > 0
    for figs in level["ratios"].values():
        assert math.isfinite(figs["request_ttft_p50_added_ms"]["median"])
    # Every request of every path is traced through each process it crossed.
    hops = result["hop_trace"]
    assert set(hops) == {f"{p} rate=6/s" for p in PATHS}
    through_gateway = ("gateway_entry -> worker_entry", "worker_first_out -> gateway_first_in")
    # Over the mux the gateway -> worker hop splits where it waits: the frame written, read.
    through_mux = ("gateway_entry -> gateway_write", "gateway_write -> worker_mux_in",
                   "worker_mux_in -> worker_entry", "worker_first_out -> gateway_first_in")
    for tag, got in hops.items():
        assert got["requests"] == 6, tag
        legs = got["legs_ms"]
        for leg in ("worker_added -> core_added", "core_added -> core_started",
                    "core_started -> core_first",
                    "client_send -> client_first (TTFT)",
                    *(through_mux if tag.startswith("gateway_mux") else
                      through_gateway if not tag.startswith("worker") else
                      ("client_sent -> worker_entry", "worker_first_out -> client_first"))):
            assert legs[leg]["n"] == 6 and legs[leg]["p50"] >= 0, (tag, leg)
        assert legs["client_send -> client_first (TTFT)"]["p50"] > legs[
            "core_started -> core_first"]["p50"], tag


@pytest.mark.slow
def test_a_closed_loop_runs_the_in_process_loop_with_late_successors_beside(
        tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.service_overhead", "--concurrency", "4", "--repeats", "1",
         "--requests-per-stream", "3", "--new-tokens", "4", "--client-procs", "1",
         "--in-process-arrive-after-ms", "2,5", "--in-process-arrive-spread-ms", "3",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    (level,) = json.loads(out.read_text())["levels"]
    late = {"in_process_after_2ms", "in_process_after_5ms", "in_process_after_2ms_spread3ms",
            "in_process_after_5ms_spread3ms"}
    assert set(level["ratios"]) == {"worker", "gateway"} | late
    for path in late:
        (run,) = level["runs"][path]
        assert run["errors"] == [] and run["output_tokens"] == 12 * 4, path
        assert math.isfinite(level["ratios"][path]["request_ttft_p50_added_ms"]["median"])


def test_poisson_arrivals_are_fixed_by_the_seed_and_start_at_zero() -> None:
    from bench.service_overhead import poisson_arrivals

    a = poisson_arrivals(200, 50.0)
    assert a == poisson_arrivals(200, 50.0)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert 2.0 < a[-1] < 6.0  # about 200 / 50 s


@pytest.mark.parametrize("flag,value,says", [
    ("--http-clients", "httpx,curl", "unknown HTTP client(s) ['curl']"),
    ("--rates", "60,0", "every rate must be > 0"),
    ("--rates", "fast", "is not comma-separated numbers"),
    ("--in-process-arrive-after-ms", "2,0", "every delay must be > 0 ms"),
    ("--in-process-arrive-after-ms", "soon", "is not comma-separated numbers"),
    ("--in-process-arrive-spread-ms", "1,2", "one spread in ms expected"),
    ("--in-process-arrive-spread-ms", "-1", "every spread must be >= 0 ms"),
    ("--in-process-arrive-spread-ms", "3", "needs --in-process-arrive-after-ms"),
    ("--trace-hops-events", "core_,loop_", "--trace-hops-events needs --trace-hops"),
    ("--trace-hops-events", ",", "--trace-hops-events needs at least one event prefix"),
])
def test_bad_flags_are_refused_before_anything_starts(
        flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    # main() parses its flags before it starts anything: parse_args is where a refusal happens.
    from bench.service_overhead import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args([flag, value])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_a_trace_folder_holding_another_runs_traces_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.service_overhead import parse_args

    (tmp_path / "123.hops").write_text("worker_entry x 1.0\n")
    with pytest.raises(SystemExit) as exited:
        parse_args(["--trace-hops", str(tmp_path)])
    assert exited.value.code == 2
    assert "already holds traces" in capsys.readouterr().err


@pytest.mark.slow
def test_worker_variants_restart_the_worker_and_measure_every_level_at_each(
        tmp_path: Path) -> None:
    """Leads and mux pump times (every pair), each with the worker restarted at it."""
    out = tmp_path / "overhead.json"
    res = subprocess.run(
        [sys.executable, "-m", "bench.service_overhead", "--concurrency", "2,4", "--repeats",
         "1", "--requests-per-stream", "2", "--new-tokens", "4", "--client-procs", "1",
         "--worker-admission-leads", "0,1", "--worker-mux-pump-ms", "0,0.5",
         "--trace-hops", str(tmp_path / "hops"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "worker restarted at lead=1ms pump=0.5ms" in res.stdout
    result = json.loads(out.read_text())
    # Hop traces keep the variants apart: each one's requests under its own tags.
    assert {f"{path} c={c} lead={lead}ms pump={pump}ms" for path in ("worker", "gateway")
            for c in (2, 4) for lead in (0, 1) for pump in (0, 0.5)} == set(result["hop_trace"])
    levels = result["levels"]
    assert [(lv["worker_admission_lead_ms"], lv["worker_mux_pump_ms"], lv["concurrency"])
            for lv in levels] == [(lead, pump, c) for lead in (0, 1) for pump in (0, 0.5)
                                  for c in (2, 4)]
    # Which host it ran on, and how fast that host started the stack.
    assert result["host_cpu"]["cores"] >= 1 and result["host_cpu"]["model"]
    assert result["tokenizers"] == tokenizers.__version__  # the front's text window's library
    assert result["worker_admission_lead_ms_default"] == EngineConfig().admission_lead_ms
    assert 0 < result["startup_s"]["assets_s"] < result["startup_s"]["stack_routable_s"]
    # No pacer without a lead, so no pacer summary either.
    assert not any("pacer_latest" in lv for lv in levels if lv["worker_admission_lead_ms"] == 0)
    fronts: dict[tuple[float, float], float] = {}  # each worker variant's front, in all
    for level in levels:  # the restarted worker serves every path, through the gateway too
        for path in ("worker", "gateway"):
            (run,) = level["runs"][path]
            assert run["errors"] == [], (path, run["errors"])
            assert run["output_tokens"] == level["requests"] * 4, path
            # How busy each process was: the restarted worker's own front and core, measured.
            busy = run["cpu_busy"]
            assert set(busy) == {"worker_front", "engine_core", "gateway_busiest",
                                 "gateway_mean"}, busy
            assert 0 <= busy["worker_front"] < 2 and 0 < busy["engine_core"] < 2, busy
            variant = (level["worker_admission_lead_ms"], level["worker_mux_pump_ms"])
            fronts[variant] = fronts.get(variant, 0.0) + busy["worker_front"]
    # /proc counts CPU in 10 ms ticks, and one of these ~40 ms runs may cost the front less
    # than one: each restarted front must show its CPU over its four runs.
    assert len(fronts) == 4 and all(v > 0 for v in fronts.values()), fronts


def test_the_pacing_report_prints_the_workers_pacer_lines_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.service_overhead import pacing_report
    from slora_core.admission import AdmissionPacer

    log = tmp_path / "worker-0.log"
    line = f"2026-12-07 engine-core INFO x: {AdmissionPacer(lead_s=0.001).summary()}"
    log.write_text(f"2026-12-07 engine-core INFO x: serving\n{line}\n")
    pacing_report(log)
    pacing_report(tmp_path / "absent.log")  # a worker that never logged: nothing
    assert capsys.readouterr().out == line + "\n"


@pytest.mark.slow
def test_an_events_filter_leaves_only_the_cores_events_and_no_legs(tmp_path: Path) -> None:
    out, hops = tmp_path / "overhead.json", tmp_path / "hops"
    res = subprocess.run(
        [sys.executable, "-m", "bench.service_overhead", "--concurrency", "2", "--repeats",
         "1", "--requests-per-stream", "2", "--new-tokens", "4", "--client-procs", "1",
         "--trace-hops", str(hops), "--trace-hops-events", "core_,loop_", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trace_hops_events"] == ["core_", "loop_"] and "hop_trace" not in result
    events = {line.split()[0] for f in hops.glob("*.hops") for line in f.read_text().splitlines()}
    # The core traced its requests; no other process wrote an event.
    assert {"core_added", "core_started", "core_first", "core_finish"} <= events
    assert all(e.startswith(("core_", "loop_")) for e in events), events
