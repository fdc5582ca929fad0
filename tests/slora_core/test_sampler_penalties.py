"""vLLM's sampling extras in the batched sampler (logit_bias, presence and frequency penalties,
min-p, their order with the repetition penalty and min_new_tokens) against a straightforward
per-row torch reference, on the CPU and, where there is one, the GPU."""

from __future__ import annotations

import random

import pytest
import torch

from slora_core.sampler import (
    Sampler,
    apply_frequency_presence,
    apply_logit_bias,
    apply_min_p,
    token_counts,
)
from slora_core.sampling_params import SamplingParams

VOCAB = 40
EOS = 3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_scores(logits: torch.Tensor, p: SamplingParams, history: list[int],
                     generated: int, eos: tuple[int, ...] = (EOS,)) -> torch.Tensor:
    """One row, token by token, in float64: bias, min-tokens mask, repetition penalty over the
    whole history, then frequency/presence over the generated tail."""
    x = logits.double().clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if generated < p.min_new_tokens:
        for token in p.stop_token_ids + (() if p.ignore_eos else eos):
            x[token] = float("-inf")
    if p.repetition_penalty != 1.0:
        for token in set(history):
            x[token] = x[token] * p.repetition_penalty if x[token] < 0 else (
                x[token] / p.repetition_penalty)
    output = history[len(history) - generated:] if generated else []
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return x


def reference_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = scores.double().softmax(-1)
    keep = probs >= min_p * probs.max()
    return torch.where(keep, scores.double(), torch.full_like(scores.double(), float("-inf")))


def random_params(rng: random.Random) -> SamplingParams:
    bias = {rng.randrange(VOCAB): rng.choice([-100.0, -5.0, 2.5, 100.0])
            for _ in range(rng.randrange(4))}
    return SamplingParams(
        temperature=0.0, logit_bias=bias, min_new_tokens=rng.choice([0, 0, 5]),
        max_new_tokens=64, stop_token_ids=tuple(rng.sample(range(VOCAB), 2)),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 1.5, -0.7, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.4, -2.0, 1.0]))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_choices_equal_the_reference_over_mixed_batches(device: str) -> None:
    rng = random.Random(0)
    for trial in range(20):
        batch = rng.randrange(1, 12)
        params = [random_params(rng) for _ in range(batch)]
        histories = [[rng.randrange(VOCAB + 3) % VOCAB for _ in range(rng.randrange(0, 30))]
                     for _ in range(batch)]
        generated = [rng.randrange(0, len(h) + 1) for h in histories]
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(trial)) * 2
        got = Sampler().sample(logits.to(device), params, [None] * batch, histories, generated,
                               (EOS,))
        want = [int(reference_scores(logits[b], params[b], histories[b], generated[b]).argmax())
                for b in range(batch)]
        assert [t.token_id for t in got] == want, trial


@pytest.mark.parametrize("device", DEVICES)
def test_batched_penalty_and_bias_tensors_equal_the_reference(device: str) -> None:
    rng = random.Random(1)
    batch = 9
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(3))
    outputs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(12))] for _ in range(batch)]
    outputs[0] = [VOCAB + 5, -1, 2, 2]  # out-of-vocab ids and a placeholder are ignored
    freq = [rng.uniform(-2, 2) for _ in range(batch)]
    pres = [rng.uniform(-2, 2) for _ in range(batch)]
    biases = [tuple((rng.randrange(VOCAB), rng.uniform(-100, 100)) for _ in range(3))
              for _ in range(batch)]
    counts = token_counts(outputs, VOCAB, torch.device(device))
    got = apply_frequency_presence(apply_logit_bias(logits.to(device), biases), freq, pres, counts)
    for b in range(batch):
        p = SamplingParams(frequency_penalty=freq[b], presence_penalty=pres[b],
                           logit_bias=dict(biases[b]))
        kept = [t for t in outputs[b] if 0 <= t < VOCAB]
        want = reference_scores(logits[b], p, kept, len(kept))
        torch.testing.assert_close(got[b].cpu().double(), want, rtol=1e-5, atol=1e-4)


def test_repeated_bias_ids_add_up_and_out_of_range_ids_are_dropped() -> None:
    logits = torch.zeros(2, VOCAB)
    got = apply_logit_bias(logits, [((4, 1.0), (4, 2.0), (VOCAB, 50.0)), ()])
    assert got[0, 4] == 3.0 and got[0].abs().sum() == 3.0 and got[1].abs().sum() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_equals_the_reference_per_row(device: str) -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    ms = [0.0, 0.05, 0.3, 1.0, 0.5]
    got = apply_min_p(logits.to(device), ms).cpu()
    for b, m in enumerate(ms):
        want = logits[b].double() if m == 0 else reference_min_p(logits[b], m)
        assert torch.equal(torch.isinf(got[b]), torch.isinf(want)), b
    assert int(torch.isfinite(got[3]).sum()) == 1  # min_p 1: the most likely token alone


def test_min_p_sampling_stays_in_its_support_with_softmax_frequencies() -> None:
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -2.0, -1.0]])
    draws, temperature, min_p = 6000, 0.8, 0.2
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * draws
    out = Sampler(seed=11).sample(logits.expand(draws, -1), params, [None] * draws,
                                  [[]] * draws, [0] * draws, ())
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=6).double()
    support = reference_min_p(logits[0] / temperature, min_p)
    probs = support.softmax(-1)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(
        torch.nonzero(probs).flatten().tolist())
    expected = probs * draws
    keep = expected > 0
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 16.3  # at most 3 degrees of freedom: P(chi2 > 16.3) = 0.001


def test_presence_and_frequency_penalties_spare_the_prompt() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 1.0, 0.9
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=0.5)
    # token 5 is in the prompt only: not penalised; token 5 chosen
    assert Sampler().sample(logits, [p], [None], [[5, 5, 5]], [0], ())[0].token_id == 5
    # once generated, it is: 1.0 - 2.0 - 0.5 < 0.9
    assert Sampler().sample(logits, [p], [None], [[5, 5, 5]], [1], ())[0].token_id == 6


@pytest.mark.parametrize(("field", "value", "words"), [
    ("logit_bias", {1: 100.5}, "logit_bias values must be in"),
    ("logit_bias", {-2: 1.0}, "logit_bias token id"),
    ("logit_bias", {1: float("nan")}, "finite"),
    ("presence_penalty", 2.5, "presence_penalty must be in"),
    ("frequency_penalty", -3, "frequency_penalty must be in"),
    ("min_p", 1.5, "min_p must be in"),
    ("prompt_logprobs", 21, "prompt_logprobs"),
])
def test_bad_extras_raise_value_error_naming_the_field(field: str, value: object,
                                                       words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_needs_history_only_with_a_penalty() -> None:
    assert not SamplingParams(logit_bias={1: 2.0}, min_p=0.1).needs_history
    assert SamplingParams(presence_penalty=0.1).needs_history
    assert SamplingParams(frequency_penalty=-0.1).needs_history
    assert SamplingParams(repetition_penalty=1.1).needs_history
