"""The greedy-agreement verdict of the GPU numerics benches: a disagreement with HF float32 is a
near-tie when HF float32's margin is within twice the dtype's logit noise there, and a mode
short of HF's own agreement only by near-ties (and by a count gap inside counting noise) is
still faithful."""

from __future__ import annotations

import torch

from bench.numerics_common import agreement_verdict, disagreements


def test_disagreements_carry_the_margin_and_the_noise() -> None:
    ref32 = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.9, 0.0], [5.0, 0.0, 1.0]])
    ref = ref32 + torch.tensor([[0.0, 0.0, 0.0], [-0.06, 0.0, 0.0], [0.0, 0.0, 0.1]])
    got = disagreements([0, 1, 2], ref, ref32)
    assert [d["position"] for d in got] == [1, 2]
    near, far = got
    assert near["hf_fp32_token"] == 0 and near["token"] == 1
    assert abs(near["hf_fp32_margin"] - 0.1) < 1e-6
    assert abs(near["hf_same_dtype_max_abs_logit_err"] - 0.06) < 1e-6
    assert near["within_noise"]  # 0.1 <= 2 * 0.06
    assert abs(far["hf_fp32_margin"] - 4.0) < 1e-6 and not far["within_noise"]


def test_verdict_allows_near_ties_within_counting_noise() -> None:
    assert agreement_verdict(2, 2, 2)["faithful"]  # as good as HF, whatever the margins
    fp16 = agreement_verdict(3, 2, 0)  # the H200 fp16 case: one position short, a near-tie
    assert fp16["faithful"] and not fp16["agreement_at_least_hf"]
    assert not agreement_verdict(3, 2, 1)["faithful"]  # one disagreement beyond the noise
    assert not agreement_verdict(30, 2, 0)["faithful"]  # near-ties, but far too many
