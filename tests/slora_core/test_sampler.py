"""Sampler and SamplingParams against Hugging Face's logits processors and exact distributions."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from slora_core.sampler import (
    Sampler,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    make_generator,
    token_mask,
)
from slora_core.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * 3


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator | None] | None = None,
            history: list[list[int]] | None = None, generated: list[int] | None = None,
            eos: tuple[int, ...] = (EOS,)) -> list[int]:
    batch = len(params)
    out = sampler.sample(logits, params, generators or [None] * batch,
                         history or [[] for _ in range(batch)], generated or [0] * batch, eos)
    return [t.token_id for t in out]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    expected = probs * draws
    support = expected > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


def test_greedy_equals_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert _sample(Sampler(), logits, params) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("ks", [[1, 5, 0, 49, 50, 80], [3, 3, 3, 3, 3, 3]])
def test_top_k_support_matches_hf(ks: list[int]) -> None:
    logits = _logits(len(ks))
    ids = torch.zeros(len(ks), 1, dtype=torch.long)
    ours = apply_top_k(logits, ks)
    for b, k in enumerate(ks):
        ref = logits[b:b + 1] if k == 0 else TopKLogitsWarper(k)(ids[b:b + 1], logits[b:b + 1])
        assert torch.equal(ours[b].isfinite(), ref[0].isfinite())
        assert torch.equal(ours[b][ours[b].isfinite()], logits[b][ref[0].isfinite()])


def test_top_k_keeps_ties_like_hf() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    ref = TopKLogitsWarper(2)(torch.zeros(1, 1, dtype=torch.long), logits)
    assert apply_top_k(logits, [2]).isfinite().tolist() == ref.isfinite().tolist()
    assert apply_top_k(logits, [2]).isfinite().sum() == 3


@pytest.mark.parametrize("ps", [[0.05, 0.3, 0.5, 0.9, 0.999, 1.0]])
def test_top_p_support_matches_hf(ps: list[float]) -> None:
    logits = _logits(len(ps), seed=1)
    ids = torch.zeros(len(ps), 1, dtype=torch.long)
    ours = apply_top_p(logits, ps)
    for b, p in enumerate(ps):
        ref = TopPLogitsWarper(p)(ids[b:b + 1], logits[b:b + 1])
        assert torch.equal(ours[b].isfinite(), ref[0].isfinite()), f"top_p={p}"
    assert ours[0].isfinite().sum() >= 1
    assert ours[-1].isfinite().all()


def test_top_k_then_top_p_after_temperature_matches_hf_chain() -> None:
    logits = _logits(4, seed=2)
    settings = [(0.5, 10, 0.8), (1.3, 0, 0.6), (0.9, 3, 1.0), (2.0, 20, 0.95)]
    ids = torch.zeros(1, 1, dtype=torch.long)
    scaled = logits / torch.tensor([t for t, _, _ in settings])[:, None]
    ours = apply_top_p(apply_top_k(scaled, [k for _, k, _ in settings]),
                       [p for _, _, p in settings])
    for b, (t, k, p) in enumerate(settings):
        ref = TemperatureLogitsWarper(t)(ids, logits[b:b + 1].clone())
        if k:
            ref = TopKLogitsWarper(k)(ids, ref)
        ref = TopPLogitsWarper(p)(ids, ref)
        assert torch.equal(ours[b].isfinite(), ref[0].isfinite())
        torch.testing.assert_close(ours[b][ours[b].isfinite()], ref[0][ref[0].isfinite()])


def test_repetition_penalty_matches_hf() -> None:
    logits = _logits(3, seed=3)
    history = [[1, 2, 2, 40, 9], [0, 49], [5, 6, 7, 8, 9, 10, 11]]
    penalties = [1.3, 0.7, 2.0]
    seen = token_mask(history, VOCAB, logits.device)
    ours = apply_repetition_penalty(logits, penalties, seen)
    for b, (h, pen) in enumerate(zip(history, penalties, strict=True)):
        ref = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([h]), logits[b:b + 1].clone())
        torch.testing.assert_close(ours[b], ref[0], rtol=0, atol=0)


def test_repetition_penalty_changes_greedy_choice_and_ignores_out_of_vocab_ids() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    history = [[0, 0, 99, -3]]
    assert _sample(Sampler(), logits, [SamplingParams(temperature=0.0)], history=history) == [0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    assert _sample(Sampler(), logits, params, history=history) == [1]


def test_min_new_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 3] = 9.0
    logits[:, 4] = 8.0
    greedy_min = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[3])
    params = [greedy_min, greedy_min, SamplingParams(temperature=0.0, min_new_tokens=2,
                                                     ignore_eos=True)]
    # Row 0 is still under min_new_tokens: EOS and stop id 3 are masked. Row 1 reached it.
    # Row 2 ignores EOS, so EOS is an ordinary token and is not masked.
    assert _sample(Sampler(), logits, params, generated=[1, 2, 0]) == [4, EOS, EOS]
    sampled = [SamplingParams(temperature=1.0, min_new_tokens=5, stop_token_ids=(3,))] * 200
    tokens = _sample(Sampler(seed=0), logits[:1].expand(200, -1), sampled, generated=[0] * 200)
    assert EOS not in tokens and 3 not in tokens


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = _logits(4, seed=4)
    params = [SamplingParams(temperature=0.0, top_logprobs=5),
              SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, top_logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.5, top_logprobs=20),
              SamplingParams(temperature=2.0, top_logprobs=1)]
    out = Sampler(seed=1).sample(logits, params, [None] * 4, [[1, 2]] * 4, [0] * 4, [EOS])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for b, (tok, p) in enumerate(zip(out, params, strict=True)):
        assert math.isclose(tok.logprob, float(ref[b, tok.token_id]), abs_tol=1e-5)
        assert len(tok.top_logprobs) == p.top_logprobs
        best = ref[b].topk(p.top_logprobs) if p.top_logprobs else None
        if best is not None:
            assert [t for t, _ in tok.top_logprobs] == best.indices.tolist()
            for (_, lp), want in zip(tok.top_logprobs, best.values.tolist(), strict=True):
                assert math.isclose(lp, want, abs_tol=1e-5)


def test_temperature_sampling_frequencies_match_softmax() -> None:
    vocab, draws, temperature = 8, 20000, 0.7
    logits = _logits(1, vocab, seed=5)
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    params = [SamplingParams(temperature=temperature)] * draws
    tokens = _sample(Sampler(seed=123), logits.expand(draws, -1), params)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001; the seed makes the draw deterministic.
    assert _chi_square(counts, probs, draws) < 24.3


def test_top_k_top_p_sampling_frequencies_match_hf_distribution() -> None:
    vocab, draws = 12, 20000
    logits = _logits(1, vocab, seed=6)
    ids = torch.zeros(1, 1, dtype=torch.long)
    ref = TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(6)(ids, TemperatureLogitsWarper(1.5)(
        ids, logits.clone())))
    probs = torch.softmax(ref[0].double(), dim=-1)
    params = [SamplingParams(temperature=1.5, top_k=6, top_p=0.9)] * draws
    tokens = _sample(Sampler(seed=7), logits.expand(draws, -1), params)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    dof = int((probs > 0).sum()) - 1
    # Upper 0.001 quantiles of chi-square for 1..11 degrees of freedom.
    critical = [10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6, 31.3][dof - 1]
    assert _chi_square(counts, probs, draws) < critical


def _run_steps(sampler: Sampler, logits_per_step: list[torch.Tensor],
               params: list[SamplingParams], generators: list[torch.Generator | None],
               row: int) -> list[int]:
    out = []
    for logits in logits_per_step:
        out.append(_sample(sampler, logits, params, generators)[row])
    return out


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    steps = 6
    logits = [_logits(5, seed=10 + s) for s in range(steps)]
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = _run_steps(Sampler(), [x[2:3] for x in logits], [target],
                       [make_generator(target, "cpu")], 0)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7),
              target, SamplingParams(temperature=1.2, top_k=4),
              SamplingParams(temperature=0.5, repetition_penalty=1.3)]
    gens = [make_generator(p, "cpu") for p in others]
    mixed = _run_steps(Sampler(), logits, others, gens, 2)
    assert alone == mixed
    again = _run_steps(Sampler(), [x[2:3] for x in logits], [target],
                       [make_generator(target, "cpu")], 0)
    assert again == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=43)
    other = _run_steps(Sampler(), [x[2:3] for x in logits], [other_seed],
                       [make_generator(other_seed, "cpu")], 0)
    assert other != alone


def test_make_generator_is_none_without_seed() -> None:
    assert make_generator(SamplingParams(), "cpu") is None


def test_batch_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(_logits(2), [SamplingParams()] * 2, [None], [[], []], [0, 0], [EOS])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler().sample(torch.zeros(VOCAB), [SamplingParams()], [None], [[]], [0], [EOS])


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")), ("seed", -1),
    ("seed", 2**64), ("max_new_tokens", 0), ("min_new_tokens", -1), ("min_new_tokens", 65),
    ("stop", "eos"), ("stop", ("",)), ("stop", (3,)), ("stop_token_ids", (-1,)),
    ("stop_token_ids", ("a",)), ("ignore_eos", 1), ("top_logprobs", 21), ("top_logprobs", -1),
])
def test_bad_params_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("[")[0]):
        SamplingParams(**{field: value})


def test_params_normalise_lists_to_tuples() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2], temperature=1, top_p=1)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (1, 2)
    assert isinstance(p.temperature, float) and hash(p) == hash(SamplingParams(
        stop=("a", "bc"), stop_token_ids=(1, 2)))
