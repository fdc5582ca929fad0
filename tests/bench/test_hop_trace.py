"""bench.hop_trace joins the events each process traced (services/common/hop_trace.py) into one
timeline per request: core events through the front's `worker_added`, legs between the events a
request met, untagged requests (warm-up) and lines cut off by a killed process left out."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.hop_trace import cores, joins, legs, loops, read
from services.common import hop_trace


def test_events_from_every_process_join_into_one_timeline_per_request(tmp_path: Path) -> None:
    (tmp_path / "1.hops").write_text(
        "client_tag a=worker rate=5/s 10.0\nclient_send a 10.000\nclient_sent a 10.001\n"
        "client_first a 10.020\nclient_tag b=worker rate=5/s 11.0\nclient_send b 11.000\n"
        "client_first b 11.030\n")
    (tmp_path / "2.hops").write_text(
        "worker_entry a 10.002\nworker_added a:7 10.003\nworker_first_out a 10.018\n"
        "worker_entry b 11.002\nworker_added b:8 11.003\nworker_entry warm 9.0\n"
        "worker_first_out b")  # cut off mid-line
    (tmp_path / "3.hops").write_text("core_added 7 10.004\ncore_first 7 10.016\n"
                                     "core_added 8 11.004\ncore_first 8 11.026\n")
    (tmp_path / "other.txt").write_text("client_tag c=x 1.0\n")  # not a trace file
    traced = read(tmp_path)
    requests = traced["worker rate=5/s"]
    assert set(traced) == {"worker rate=5/s"} and set(requests) == {"a", "b"}  # warm: untagged
    assert requests["a"]["core_first"] == pytest.approx(10.016)
    assert "worker_first_out" not in requests["b"]
    (summary,) = legs(traced).values()
    got = summary["legs_ms"]
    assert summary["requests"] == 2
    assert got["core_added -> core_first"]["n"] == 2
    assert got["core_added -> core_first"]["p50"] == pytest.approx(17.0)  # 12 and 22 ms
    assert got["worker_first_out -> client_first"]["p50"] == pytest.approx(2.0)
    # b skipped worker_first_out: its leg runs from the event before it.
    assert got["core_first -> client_first"]["p50"] == pytest.approx(4.0)
    assert got["client_send -> client_first (TTFT)"]["p50"] == pytest.approx(25.0)
    assert list(got)[0] == "client_send -> client_sent"  # legs in HOPS order


def test_a_restarted_workers_request_numbers_join_their_own_core(tmp_path: Path) -> None:
    """A worker restarted mid-run (another core process) numbers its requests from the start
    again: each front request joins the core events that followed its own `worker_added`,
    whichever file sorts first."""
    (tmp_path / "1.hops").write_text(
        "client_tag a=lead0 1.0\nclient_send a 10.000\nclient_first a 10.050\n"
        "client_tag c=lead1 1.0\nclient_send c 50.000\nclient_first c 50.040\n")
    (tmp_path / "2.hops").write_text("worker_added a:7 10.002\n")
    (tmp_path / "3.hops").write_text("worker_added c:7 50.002\n")
    # The restarted core's file sorts first.
    (tmp_path / "4.hops").write_text("core_added 7 50.0025\ncore_first 7 50.030\n")
    (tmp_path / "5.hops").write_text("core_added 7 10.012\ncore_first 7 10.045\n")
    got = {tag: legs({tag: reqs})[tag]["legs_ms"] for tag, reqs in read(tmp_path).items()}
    assert got["lead0"]["worker_added -> core_added"]["p50"] == pytest.approx(10.0)
    assert got["lead1"]["worker_added -> core_added"]["p50"] == pytest.approx(0.5)
    assert got["lead1"]["core_added -> core_first"]["p50"] == pytest.approx(27.5)


def test_the_core_loops_stretches_count_waits_and_the_requests_read_in_them(
        tmp_path: Path) -> None:
    """Stretches split at a pause; a request read inside a wait (before the next step())
    counts as read in one, one read outside any wait does not; stretches are named by the
    tags whose requests span them."""
    (tmp_path / "1.hops").write_text(
        "client_tag a=gateway c=2 1.0\nclient_send a 10.0\nclient_first a 10.05\n"
        "client_tag z=gateway c=9 1.0\nclient_send z 30.0\nclient_first z 30.01\n")
    (tmp_path / "2.hops").write_text(
        "loop_step 1 10.000\nloop_wait 4000:class=3 10.010\n"
        "core_added 7 10.012\n"                 # inside the wait
        "loop_step 2 10.014\ncore_started 7 10.01399\n"
        "loop_wait 0:class=3 10.020\ncore_added 8 10.021\n"  # no wait open
        "loop_step 3 10.030\nloop_step 4 10.040\ncore_started 8 10.03999\n"
        "loop_step 5 30.000\nloop_step 6 30.010\n")  # after a pause: a second stretch
    first, second = loops(cores(tmp_path), read(tmp_path))
    assert first["core"] == "2.hops" and first["tags"] == ["gateway c=2"]
    assert (first["steps"], first["waits"], first["requests"], first["read_in_wait"]) == (
        4, 1, 2, 1)
    assert first["wait_ms_mean"] == pytest.approx(4.0)
    assert (second["steps"], second["requests"], second["tags"]) == (2, 0, ["gateway c=9"])


def test_joins_tell_a_request_the_next_step_took_from_one_it_left_or_read_late(
        tmp_path: Path) -> None:
    """a joins the first step() after it reached the worker; b was read before that step()
    but first scheduled by the one after; c reached the worker before that step() but was
    read only after it began."""
    (tmp_path / "1.hops").write_text("".join(
        f"client_tag {k}=gateway c=3 1.0\nclient_send {k} {t}\n"
        for k, t in (("a", 9.990), ("b", 9.991), ("c", 9.992))))
    (tmp_path / "2.hops").write_text(
        "worker_added a:1 10.001\nworker_added b:2 10.002\nworker_added c:3 10.003\n")
    (tmp_path / "3.hops").write_text(
        "loop_step 1 10.000\ncore_added 1 10.0015\ncore_added 2 10.0025\n"
        "loop_step 2 10.005\ncore_started 1 10.00499\ncore_added 3 10.006\n"
        "loop_step 3 10.010\ncore_started 2 10.00999\ncore_started 3 10.00999\n"
        "core_first 1 10.021\ncore_first 2 10.031\ncore_first 3 10.033\n")
    got = joins(cores(tmp_path), read(tmp_path))["gateway c=3"]
    assert got["requests"] == 3
    shares = {g: v["share"] for g, v in got.items() if g != "requests"}
    assert shares == pytest.approx({"joined_next_step": 1 / 3, "read_before_it_not_taken": 1 / 3,
                                    "read_after_it_began": 1 / 3})
    assert got["joined_next_step"]["worker_added_to_core_first_ms_p50"] == pytest.approx(20.0)
    assert got["read_before_it_not_taken"]["worker_added_to_core_first_ms_p50"] == pytest.approx(
        29.0)


def test_marks_are_off_unless_the_variable_names_a_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hop_trace.ENV, raising=False)
    hop_trace.mark("worker_entry", "x")
    assert not hop_trace.enabled() and not list(tmp_path.iterdir())
    monkeypatch.setenv(hop_trace.ENV, str(tmp_path / "hops"))
    monkeypatch.setattr(hop_trace, "_file", None)
    hop_trace.mark("worker_entry", "x", at=5.0)
    hop_trace.mark("worker_first_out", "x")
    assert hop_trace._file is not None
    hop_trace._file.close()
    monkeypatch.setattr(hop_trace, "_file", None)
    (trace,) = (tmp_path / "hops").iterdir()
    first, second = trace.read_text().splitlines()
    assert first == "worker_entry x 5.000000" and second.startswith("worker_first_out x ")


def test_an_events_filter_writes_only_the_events_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hop_trace.ENV, str(tmp_path))
    monkeypatch.setenv(hop_trace.EVENTS_ENV, "core_,loop_")
    monkeypatch.setattr(hop_trace, "_file", None)
    hop_trace.mark("worker_entry", "x", at=1.0)  # filtered out: no file opened for it
    assert hop_trace._file is None and not list(tmp_path.iterdir())
    for event in ("core_added", "loop_step", "client_send", "core_first"):
        hop_trace.mark(event, "7", at=2.0)
    assert hop_trace._file is not None
    hop_trace._file.close()
    monkeypatch.setattr(hop_trace, "_file", None)
    (trace,) = tmp_path.iterdir()
    assert [line.split()[0] for line in trace.read_text().splitlines()] == [
        "core_added", "loop_step", "core_first"]
