"""bench.closed_loop_waves on the demo engine: fixed-length streams started together move in
lockstep (each wave of next requests lands before one step), spread lengths break the waves."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.closed_loop_waves import main
from bench.service_overhead import Lengths, StepLog, run_in_process


def test_fixed_lengths_run_in_waves_and_spread_lengths_do_not(tmp_path: Path) -> None:
    out = tmp_path / "waves.json"
    assert main(["--concurrency", "4", "--requests-per-stream", "3", "--new-tokens", "6",
                 "--spreads", "0,4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"command", "commit", "hardware"} <= set(result)
    fixed, spread = result["arms"]
    assert fixed["requests"] == spread["requests"] == 12
    # 4 streams of 6 tokens each, started in one step: every wave is all 4, 3 waves
    assert fixed["adds_histogram"] == {"4": 3}
    assert sum(fixed["steps_add_to_first_token"].values()) == 12
    assert spread["steps_with_adds"] > fixed["steps_with_adds"]


def test_a_spread_as_wide_as_the_length_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--new-tokens", "6", "--spreads", "0,6"])
    assert exc.value.code == 2
    assert "every spread must be in [0, --new-tokens=6)" in capsys.readouterr().err


class PacedEngine:
    """Steps of a fixed length; request r0 runs 8 tokens, every other one 1."""

    STEP_S = 0.1

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def add_request(self, rid: str, prompt: list[int], params: object,
                    adapter: str | None = None) -> None:
        self.left[rid] = 8 if rid.startswith("r0-") else 1

    def step(self) -> list[SimpleNamespace]:
        time.sleep(self.STEP_S)
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(SimpleNamespace(request_id=rid, token_ids=[7],
                                        finished=not self.left[rid]))
            if not self.left[rid]:
                del self.left[rid]
        return outs


@pytest.mark.parametrize("arrive_after_s", [0.0, 0.02])
def test_a_successor_that_arrives_after_a_step_began_waits_for_it(arrive_after_s: float) -> None:
    """Two streams: r0 keeps the engine busy for 8 steps; on the other, r1..r4 one after
    another, each successor arriving `arrive_after_s` after the step that ended its
    predecessor returned: at once it is added before the next step; 20 ms later that step
    (100 ms) has begun, so it waits for it, and its TTFT, from its arrival, is the rest of that
    step and its own."""
    log = StepLog()
    run = run_in_process(PacedEngine(), [([i], "") for i in range(5)],  # type: ignore[arg-type]
                         Lengths(1), 2, log=log, arrive_after_s=arrive_after_s)
    if arrive_after_s:
        assert log.adds == [2, 0, 1, 0, 1, 0, 1, 0]
        # Three of the five requests (r2..r4) waited: the median is theirs.
        assert run["request_ttft_p50_s"] >= 2 * PacedEngine.STEP_S - arrive_after_s
    else:
        assert log.adds == [2, 1, 1, 1, 0, 0, 0, 0]
    assert log.to_first == {1: 5}  # each first token in the step after its add


@pytest.mark.parametrize("value,says", [("0,-1", "every delay must be >= 0 ms"),
                                        ("soon", "is not comma-separated numbers")])
def test_a_bad_arrival_delay_is_a_usage_error(value: str, says: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--arrive-after-ms", value])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


class WaveEngine(PacedEngine):
    """Steps of a fixed length; every request runs 2 tokens."""

    STEP_S = 0.05

    def add_request(self, rid: str, prompt: list[int], params: object,
                    adapter: str | None = None) -> None:
        self.left[rid] = 2


@pytest.mark.parametrize("spread_s", [0.0, 0.08])
def test_successors_spread_over_a_step_split_the_waves(spread_s: float) -> None:
    """Four streams of 2-token requests finish together. Each successor arriving 1 ms late
    lands with the rest of its wave before one step; with a further uniform spread wider than
    a step (`arrive_spread_s`, seeded) a wave's successors land before different steps, as
    through a service's unequal hops, and each still counts its TTFT from its own arrival."""
    log = StepLog()
    run = run_in_process(WaveEngine(), [([i], "") for i in range(12)],  # type: ignore[arg-type]
                         Lengths(2), 4, log=log, arrive_after_s=0.001, arrive_spread_s=spread_s,
                         seed=3)
    assert run["output_tokens"] == 24 and sum(log.adds) == 12
    if spread_s:
        assert any(0 < a < 4 for a in log.adds), log.adds
    else:
        assert all(a in (0, 4) for a in log.adds), log.adds
    assert run["request_ttft_p50_s"] > WaveEngine.STEP_S
