"""What a stuck tensor-parallel run prints (gloo, 2 processes): a rank > 0 that waits too long
for rank 0 dumps every thread's stack, and SLORA_TP_DEBUG=1 logs each message of adapter or
arena changes; plus the one-buffer packing of an in-memory adapter's host shard."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from slora_core.adapter_cache import packed_pairs
from slora_core.config import EngineConfig
from slora_core.sampling_params import SamplingParams
from slora_core.tp.launch import start_tp_engine

CONFIG = dict(num_pages=16, block_size=32, max_rank=32, max_num_seqs=4,
              max_num_batched_tokens=64, tensor_parallel_size=2)


def test_packed_pairs_are_equal_views_of_one_buffer() -> None:
    gen = torch.Generator().manual_seed(0)
    pairs = {(layer, m): (torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen))
             for layer in range(3) for m in ("q_proj", "down_proj")}
    packed = packed_pairs(pairs, pin_memory=False)
    assert packed.keys() == pairs.keys()
    base = packed[(0, "q_proj")][0].untyped_storage().data_ptr()
    for key, (a, b) in pairs.items():
        pa, pb = packed[key]
        assert torch.equal(pa, a) and torch.equal(pb, b)
        assert pa.is_contiguous() and pb.is_contiguous()
        assert pa.untyped_storage().data_ptr() == pb.untyped_storage().data_ptr() == base
    mixed = {(0, "q_proj"): (torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float16))}
    assert packed_pairs(mixed, pin_memory=False) is mixed  # one dtype a buffer: left as is


def test_a_waiting_rank_dumps_its_stack_and_logs_messages(
        demo_dir: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLORA_TP_DEBUG", "1")  # the spawned rank inherits it
    tp = start_tp_engine(demo_dir / "model", EngineConfig(**CONFIG), detokenize=False,
                         timeout_s=60.0, stall_dump_s=1.0)
    err = ""
    try:
        # Rank 1 waits for rank 0's first message (it may still be making its engine when
        # start_tp_engine returns): its stack is dumped once it waited 1 s.
        deadline = time.monotonic() + 60.0
        while "in receive" not in err and time.monotonic() < deadline:
            time.sleep(0.2)
            err += capfd.readouterr().err
        tp.register_adapter("qv", demo_dir / "adapters" / "qv-r4")
        tp.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3,
                                                      ignore_eos=True), adapter="qv")
        tokens = [t for _ in range(8) if tp.has_unfinished() for out in tp.step()
                  for t in out.token_ids]
        assert len(tokens) == 3
    finally:
        tp.close(timeout_s=10.0)
    err += capfd.readouterr().err
    assert "Thread" in err and "in receive" in err and "in serve" in err, err[-3000:]
    assert "rank 1: 2 ops ['register', 'write']" in err, err[-3000:]
