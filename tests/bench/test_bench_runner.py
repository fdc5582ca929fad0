"""`python -m bench SUITE`: every registered step names a module that exists, step names say
which result they write, and the runner keeps its limits, its deadline and its record."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import bench.__main__ as runner
from bench.suites import OUT, SUITES, step

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_runs_a_module_that_exists() -> None:
    for name, steps in SUITES.items():
        assert steps, name
        for s in steps:
            module = s.argv[0]
            if module == "pytest":
                continue
            path = ROOT / (module.replace(".", "/") + ".py")
            assert path.is_file(), f"suite {name}, step {s.name}: no {path}"


def test_a_suite_runs_its_steps_and_records_them(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    script = "import sys, time; print('hi'); time.sleep(float(sys.argv[1]))"
    (tmp_path / "sleeper.py").write_text(script)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(SUITES, "probe", (
        step("quick", 30, "sleeper", "0"),
        step("stuck", 30, "sleeper", "60"),
        step("left-out", 30, "sleeper", "0"),
    ))
    out = tmp_path / "out"
    t0 = time.monotonic()
    code = runner.main(["probe", "--out", str(out), "--limit", "stuck=1", "--skip", "left-out"])
    assert time.monotonic() - t0 < 20  # the stuck step was stopped at its limit
    assert code == 1
    record = json.loads((out / "run.json").read_text())
    assert [(s["step"], s["rc"]) for s in record["steps"]] == [("quick", 0), ("stuck", 124)]
    assert record["commit"]
    assert (out / "quick.log").read_text() == "hi\n"
    assert "left-out skipped: named in --skip" in (out / "steps.log").read_text()


def test_no_step_starts_past_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SUITES, "probe", (step("late", 30, "json.tool", "--help"),))
    assert runner.main(["probe", "--out", str(tmp_path), "--budget-s", "40"]) == 0
    assert "s left before the deadline" in (tmp_path / "steps.log").read_text()


def test_an_unknown_suite_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        runner.main(["no-such-suite"])
    assert "python -m bench --list" in capsys.readouterr().err


def test_lanes_run_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sleeper.py").write_text("import sys, time; time.sleep(float(sys.argv[1]))")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(SUITES, "probe", (step("a", 30, "sleeper", "2", lane=0),
                                          step("b", 30, "sleeper", "2", lane=1)))
    t0 = time.monotonic()
    assert runner.main(["probe", "--out", str(tmp_path / "out")]) == 0
    steps = json.loads((tmp_path / "out" / "run.json").read_text())["steps"]
    # Both lanes took ~2 s each; one after the other would be 4 s at the least.
    assert {s["step"] for s in steps} == {"a", "b"}
    assert time.monotonic() - t0 < sum(s["seconds"] for s in steps)


def test_a_step_stopped_at_its_limit_stops_what_it_started(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # A bench script's children run in sessions of their own (Stack's), beyond the runner's
    # killpg: exit_on_sigterm lets the script's `finally` stop them (a 7B worker left running
    # held 32 GiB and the next step ran out of GPU memory).
    pid_file = tmp_path / "child.pid"
    (tmp_path / "starter.py").write_text(
        "import subprocess, sys, time\n"
        "from services.common.processes import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "try:\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    child.terminate()\n"
        "    child.wait()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    monkeypatch.setitem(SUITES, "probe", (step("starter", 30, "starter"),))
    t0 = time.monotonic()
    assert runner.main(["probe", "--out", str(tmp_path / "out"), "--limit", "starter=3"]) == 1
    assert time.monotonic() - t0 < 20  # SIGTERM stopped it, not the grace period's SIGKILL
    steps = json.loads((tmp_path / "out" / "run.json").read_text())["steps"]
    assert [(s["step"], s["rc"]) for s in steps] == [("starter", 124)]
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_what_a_step_leaves_running_is_killed_after_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The layer under exit_on_sigterm: a script whose `finally` could not stop its stack in the
    # grace period (its children drained one by one) left a worker core holding 32 GiB, and the
    # next two steps ran out of GPU memory (9c7f623). Each step's processes carry a marker in
    # their environment; whatever still carries it once the step is over is killed. Here one
    # step ends at its limit and one on its own, both leaving a child in its own session.
    pids = [tmp_path / "stuck.pid", tmp_path / "done.pid"]
    (tmp_path / "leaver.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "time.sleep(float(sys.argv[2]))\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    monkeypatch.setitem(SUITES, "probe", (step("stuck", 30, "leaver", str(pids[0]), "60"),
                                          step("done", 30, "leaver", str(pids[1]), "0")))
    out = tmp_path / "out"
    assert runner.main(["probe", "--out", str(out), "--limit", "stuck=3"]) == 1
    steps = json.loads((out / "run.json").read_text())["steps"]
    assert [(s["step"], s["rc"]) for s in steps] == [("stuck", 124), ("done", 0)]
    log = (out / "steps.log").read_text()
    for path, name in zip(pids, ("stuck", "done"), strict=True):
        pid = int(path.read_text())
        assert f"{name} left 1 processes running; killed [{pid}]" in log
        assert not alive(pid)


def alive(pid: int) -> bool:
    """Running (a zombie no longer runs: its parent is gone and init may not reap it here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_result_files_are_named_for_the_commit_and_the_card(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.card(["NVIDIA H200, 570.124.06"]) == "h200"
    assert runner.card(["NVIDIA H100 80GB HBM3, 570.124.06", "NVIDIA H100 80GB HBM3, 570"]) == "h100"
    assert runner.card(["Tesla T4, 535.1"]) == "tesla-t4"
    assert runner.card([]) == "cpu"
    (tmp_path / "echo_args.py").write_text("import sys; print(*sys.argv[1:])")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("SLORA_COMMIT", "0123456789abcdef")
    monkeypatch.setattr(runner, "gpus", lambda: ["NVIDIA H100 80GB HBM3, 570.124.06"])
    monkeypatch.setitem(SUITES, "probe", (step("echo", 30, "echo_args", "--out", OUT("thing")),))
    out = tmp_path / "out"
    assert runner.main(["probe", "--out", str(out)]) == 0
    assert (out / "echo.log").read_text() == f"--out {out}/thing-0123456-h100.json\n"


def test_a_run_record_names_the_hosts_cpu() -> None:
    from bench.run_record import host_cpu, run_record

    cpu = host_cpu()
    assert cpu["cores"] == len(os.sched_getaffinity(0))
    assert isinstance(cpu["model"], str) and cpu["model"]
    with open("/proc/cpuinfo") as f:  # the model this Linux host reports, as it reports it
        info = f.read()
    if "model name" in info:  # x86 hosts (ARM's cpuinfo names no model)
        assert f"model name\t: {cpu['model']}" in info
    record = run_record(["bench.x"])
    assert record["host_cpu"] == cpu
    assert record["tokenizers"] == __import__("tokenizers").__version__
