"""An idle tensor-parallel engine keeps its other ranks alive: they always wait in a receive for
rank 0's next message, and a collective that waits past the group timeout fails (NCCL's watchdog
kills the rank; gloo raises), so the engine core calls `keepalive()` while idle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slora_core.config import EngineConfig
from slora_core.sampling_params import SamplingParams
from slora_core.tp.launch import start_tp_engine

CONFIG = dict(num_pages=16, block_size=32, max_rank=32, max_num_seqs=4,
              max_num_batched_tokens=64, tensor_parallel_size=2)
# The group's timeout covers the rendezvous too: rank 1 (a spawned process importing torch) must
# join within it, which took over 5 s on the loaded 2-core CI machine (two xdist workers).
TIMEOUT_S = 12.0


def _idle_then_serve(demo_dir: Path, keepalive: bool) -> list[int]:
    tp = start_tp_engine(demo_dir / "model", EngineConfig(**CONFIG), detokenize=False,
                         timeout_s=TIMEOUT_S)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)

    def serve(request_id: str) -> list[int]:
        tp.add_request(request_id, [5, 6, 7], params)
        tokens: list[int] = []
        while tp.has_unfinished():
            for out in tp.step():
                tokens += out.token_ids
        return tokens

    try:
        # A first request: rank 1 has joined and waits in its receive from here on (its
        # start-up alone took 6.7 s of an idle window timed from start_tp_engine's return,
        # which left its wait under the timeout: DID NOT RAISE).
        assert len(serve("warm")) == 4
        for _ in range(int(1.5 * TIMEOUT_S)):  # idle well past the collective timeout
            time.sleep(1.0)
            if keepalive:
                tp.keepalive()
        return serve("r")
    finally:
        tp.close(timeout_s=5.0)


def test_keepalive_keeps_idle_ranks_within_the_collective_timeout(demo_dir: Path) -> None:
    assert len(_idle_then_serve(demo_dir, keepalive=True)) == 4
    # Without it, rank 1's pending receive times out and the next step fails.
    with pytest.raises(RuntimeError):
        _idle_then_serve(demo_dir, keepalive=False)
