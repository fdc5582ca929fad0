"""Batched token sampling: logits of B sequences in, one token (plus logprobs) per sequence out.

Order as vLLM: logit bias, min-new-tokens mask, penalties (repetition over prompt + output,
frequency and presence over the output), then temperature, min-p, top-k, top-p, and sampling. Every step works on the whole [B, V] batch at once; the only per-row Python
work is the random draw of rows that own a seeded generator, and the final unpacking of one host
transfer into `SampledToken`s.

Sampling uses the exponential race: token = argmax(p_i / q_i) with q_i ~ Exp(1) i.i.d., which picks
token i with probability exactly p_i, and needs one random vector per row whatever the support.
A seeded row's vector comes from its own generator alone, so its tokens do not depend on the
rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from slora_core.host_copy import host_values, row_index
from slora_core.sampling_params import SamplingParams
from slora_core.step_inputs import to_device
from slora_core.structured.bitmask import GrammarMask, apply_grammar_mask

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SampledToken:
    """One sampled token. Logprobs are log-softmax of the raw model logits (before any penalty,
    temperature or truncation), so they describe the model, not the sampling settings."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]  # best `top_logprobs` (token, logprob), best first
    # False when the row of logits held a NaN or an infinity: `token_id` is then meaningless
    # (the argmax of garbage) and must not be emitted.
    finite: bool = True


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (None when `params.seed` is None).

    Create it once per request and pass it to every `Sampler.sample` call of that request."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


# Odd 64-bit constant (2**64 / golden ratio) spacing the positions' seeds.
_SEED_STEP = 0x9E3779B97F4A7C15
_U64 = 2**64


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's random draw at output `position`: the draws are a
    function of (seed, position), not of a generator's running state, so a stream resumed
    elsewhere after `n` tokens with `advance_seed(seed, n)` draws what it would have drawn
    (docs/failover.md). splitmix64's finalizer over seed + position * step."""
    x = (seed + position * _SEED_STEP) % _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _U64
    return x ^ (x >> 31)


def advance_seed(seed: int, positions: int) -> int:
    """The seed under which position p of a stream continued after `positions` tokens draws
    what position p + positions of the original stream drew."""
    return (seed + positions * _SEED_STEP) % _U64


def token_mask(rows: Sequence[Sequence[int]], vocab_size: int,
               device: torch.device) -> torch.Tensor:
    """[B, V] bool, True where row b lists the token. Ids outside [0, V) are ignored, as HF does
    for ids the output layer cannot produce."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    # np.fromiter over a flat chain is several times faster than torch.tensor on nested lists;
    # histories of thousands of ids per row go through here every step.
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row_of = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    # Out-of-range ids land in an extra column V that is dropped afterwards.
    ids = np.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
    mask = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    # A device scalar: `mask[rows, ids] = True` copies the value from the host and syncs.
    mask.index_put_(tuple(to_device([row_of, ids], device)),
                    torch.ones((), dtype=torch.bool, device=device))
    return mask[:, :vocab_size]


def token_counts(rows: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """[B, V] float32: how many times row b lists each token (ids outside [0, V) ignored)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    row_of = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    ids = np.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    ones = torch.ones(len(ids), dtype=torch.float32, device=device)
    counts.index_put_(tuple(to_device([row_of, ids], device)), ones, accumulate=True)
    return counts[:, :vocab_size]


def apply_logit_bias(scores: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]],
                     ) -> torch.Tensor:
    """OpenAI's `logit_bias`: row b's (token id, bias) pairs added to its logits, the whole
    batch in one scatter (ids outside [0, V) ignored)."""
    if not any(biases):
        return scores
    vocab = scores.shape[-1]
    rows = [b for b, pairs in enumerate(biases) for _ in pairs]
    ids = [t if 0 <= t < vocab else vocab for pairs in biases for t, _ in pairs]
    values = [v for pairs in biases for _, v in pairs]
    dev = scores.device
    bias = torch.zeros(scores.shape[0], vocab + 1, dtype=scores.dtype, device=dev)
    bias.index_put_((row_index(rows, dev), host_values(ids, torch.long, dev)),
                    host_values(values, scores.dtype, dev), accumulate=True)
    return scores + bias[:, :vocab]


def apply_frequency_presence(scores: torch.Tensor, frequency: Sequence[float],
                             presence: Sequence[float], counts: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties with per-row values: logits minus frequency x count minus presence x
    (count > 0), where `counts` [B, V] counts each token in the row's generated output."""
    dev, dtype = scores.device, scores.dtype
    f = host_values(frequency, dtype, dev)[:, None]
    p = host_values(presence, dtype, dev)[:, None]
    return scores - f * counts - p * (counts > 0).to(dtype)


def apply_min_p(scores: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """vLLM's min-p with a per-row value (0 = off): tokens whose probability is below
    min_p x the row's top probability are set to -inf; the most likely token always stays."""
    rows = [b for b, m in enumerate(min_p) if m > 0.0]
    if not rows:
        return scores
    ms = [min_p[b] for b in rows]

    def warp(x: torch.Tensor) -> torch.Tensor:
        m = host_values(ms, x.dtype, x.device)[:, None]
        probs = x.softmax(dim=-1)
        return x.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), float("-inf"))

    return _on_rows(scores, rows, warp)


def apply_repetition_penalty(scores: torch.Tensor, penalties: Sequence[float],
                             seen: torch.Tensor) -> torch.Tensor:
    """HF `RepetitionPenaltyLogitsProcessor` with a per-row penalty: the logits of seen tokens
    ([B, V] bool) are divided by the penalty when positive, multiplied when negative."""
    p = host_values(penalties, scores.dtype, scores.device)[:, None]
    penalised = torch.where(scores < 0, scores * p, scores / p)
    return torch.where(seen, penalised, scores)


def _on_rows(scores: torch.Tensor, rows: list[int],
             warp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`warp` applied to the listed rows only; the whole batch when every row is listed."""
    if len(rows) == scores.shape[0]:
        return warp(scores)
    index = row_index(rows, scores.device)
    out = scores.clone()
    out[index] = warp(scores[index])
    return out


def apply_top_k(scores: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """HF `TopKLogitsWarper` with a per-row k (0 = off): keeps every token whose score is at
    least the k-th largest (ties at the boundary stay), sets the rest to -inf."""
    vocab = scores.shape[-1]
    # Rows with k off are left out, so one such row does not turn topk(k) into a full sort.
    rows = [b for b, k in enumerate(top_k) if 0 < k < vocab]
    if not rows:
        return scores
    ks = [top_k[b] for b in rows]

    def warp(x: torch.Tensor) -> torch.Tensor:
        # The ks come from the host, so the width of topk needs no device sync.
        k = host_values(ks, torch.long, x.device)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
        return x.masked_fill(x < kth, float("-inf"))

    return _on_rows(scores, rows, warp)


def apply_top_p(scores: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """HF `TopPLogitsWarper` with a per-row p in (0, 1]: drops the least likely tokens whose
    cumulative probability is <= 1 - p, always keeping the most likely token. Rows with p = 1
    are untouched."""
    rows = [b for b, p in enumerate(top_p) if p < 1.0]
    if not rows:
        return scores
    ps = [top_p[b] for b in rows]

    def warp(x: torch.Tensor) -> torch.Tensor:
        p = host_values(ps, x.dtype, x.device)
        sorted_x, sorted_idx = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - p)[:, None]
        remove_sorted[:, -1] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        return x.masked_fill(remove, float("-inf"))

    return _on_rows(scores, rows, warp)


class Sampler:
    """Turns a batch of logits into tokens. Holds only the default generator for unseeded rows;
    everything per request (params, generator, history) is passed to `sample`."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._default: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator:
        gen = self._default.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._default[device] = gen
        return gen

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               token_history: Sequence[Sequence[int]], num_generated: Sequence[int],
               eos_token_ids: Sequence[int], grammar: GrammarMask | None = None,
               ) -> list[SampledToken]:
        """Sample one token per row of `logits` [B, V].

        `generators[b]` is the request's own generator (see `make_generator`) or None for an
        unseeded request; `token_history[b]` is prompt + generated ids (for the penalties);
        `num_generated[b]` counts generated tokens (for `min_new_tokens` and the output
        penalties). Greedy rows (temperature 0) take the argmax of the biased, penalised, masked
        logits and draw nothing. `grammar`: the constrained rows' allowed tokens (structured
        output), applied last, so no bias or penalty revives a token the grammar forbids.
        Makes one device-to-host transfer."""
        chosen, raw_logprobs, finite = self._choose(logits, params, generators, token_history,
                                                    num_generated, eos_token_ids, grammar)
        return _unpack(_pack(chosen, raw_logprobs, finite, params).cpu().tolist(), params)

    def sample_async(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None],
                     token_history: Sequence[Sequence[int]], num_generated: Sequence[int],
                     eos_token_ids: Sequence[int], grammar: GrammarMask | None = None,
                     ) -> PendingSample:
        """`sample` without waiting: the chosen ids stay on the device (the next step reads
        them there) and the host copy is started; `PendingSample.result()` waits for it."""
        chosen, raw_logprobs, finite = self._choose(logits, params, generators, token_history,
                                                    num_generated, eos_token_ids, grammar)
        return PendingSample(chosen, _pack(chosen, raw_logprobs, finite, params), params)

    def _choose(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                token_history: Sequence[Sequence[int]], num_generated: Sequence[int],
                eos_token_ids: Sequence[int], grammar: GrammarMask | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen ids [B], raw logprobs [B, V], finite [B] bool), all left on the device."""
        _check_batch(logits, params, generators, token_history, num_generated)
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        scores = apply_logit_bias(logits, [p.logit_bias for p in params])
        scores = _mask_min_tokens(scores, params, num_generated, eos_token_ids)
        scores = self._penalise(scores, params, token_history, num_generated)
        scores = apply_grammar_mask(scores, grammar)
        chosen = scores.argmax(dim=-1)
        if not all(p.is_greedy for p in params):
            sampled = self._sample_rows(_warp(scores, params), params, generators,
                                        num_generated)
            greedy = host_values([p.is_greedy for p in params], torch.bool, logits.device)
            chosen = torch.where(greedy, chosen, sampled)
        return chosen, raw_logprobs, finite

    @staticmethod
    def _penalise(scores: torch.Tensor, params: Sequence[SamplingParams],
                  token_history: Sequence[Sequence[int]], num_generated: Sequence[int],
                  ) -> torch.Tensor:
        """Repetition penalty over prompt + output, then frequency and presence penalties over
        the output (the last `num_generated[b]` ids of the history)."""
        if any(p.repetition_penalty != 1.0 for p in params):
            # Rows without a penalty contribute no ids: less to pad and copy to the device.
            rows = [h if p.repetition_penalty != 1.0 else () for p, h in
                    zip(params, token_history, strict=True)]
            seen = token_mask(rows, scores.shape[-1], scores.device)
            scores = apply_repetition_penalty(scores, [p.repetition_penalty for p in params],
                                              seen)
        if all(p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 for p in params):
            return scores
        outputs = [h[max(0, len(h) - n):] if n and (p.frequency_penalty or p.presence_penalty) else ()
                   for p, h, n in zip(params, token_history, num_generated, strict=True)]
        counts = token_counts(outputs, scores.shape[-1], scores.device)
        return apply_frequency_presence(scores, [p.frequency_penalty for p in params],
                                        [p.presence_penalty for p in params], counts)

    def _sample_rows(self, scores: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None],
                     positions: Sequence[int] | None = None) -> torch.Tensor:
        """`positions[b]`: the output position row b samples (its tokens generated so far); a
        seeded row's draw is then a function of (seed, position) alone (`position_seed`)."""
        probs = scores.softmax(dim=-1)
        q = torch.ones_like(probs)
        unseeded = [b for b, (p, g) in enumerate(zip(params, generators, strict=True))
                    if g is None and not p.is_greedy]
        if unseeded:
            gen = self._default_generator(probs.device)
            q[row_index(unseeded, probs.device)] = torch.empty(
                len(unseeded), probs.shape[-1], device=probs.device).exponential_(generator=gen)
        for b, (p, g) in enumerate(zip(params, generators, strict=True)):
            if g is not None and not p.is_greedy:
                if p.seed is not None and positions is not None:
                    g.manual_seed(position_seed(p.seed, positions[b]))
                q[b].exponential_(generator=g)
        # exponential_ may return exactly 0 in float32; clamping keeps p/q finite at no
        # measurable cost to the distribution.
        return (probs / q.clamp_min_(_TINY)).argmax(dim=-1)


def _check_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 token_history: Sequence[Sequence[int]], num_generated: Sequence[int]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    lengths = {"params": len(params), "generators": len(generators),
               "token_history": len(token_history), "num_generated": len(num_generated)}
    bad = {name: n for name, n in lengths.items() if n != batch}
    if bad:
        raise ValueError(f"batch of {batch} logits rows but {bad}")


def _mask_min_tokens(scores: torch.Tensor, params: Sequence[SamplingParams],
                     num_generated: Sequence[int], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Set the logits of stopping tokens (EOS unless ignored, and `stop_token_ids`) to -inf in
    rows that have not yet generated `min_new_tokens`."""
    rows: list[tuple[int, ...]] = []
    for p, n in zip(params, num_generated, strict=True):
        if n >= p.min_new_tokens:
            rows.append(())
        else:
            rows.append(p.stop_token_ids + (() if p.ignore_eos else tuple(eos_token_ids)))
    if not any(rows):
        return scores
    return scores.masked_fill(token_mask(rows, scores.shape[-1], scores.device), float("-inf"))


def _warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p; a row that does not use a step skips it."""
    # Greedy rows divide by 1: their sampled token is discarded anyway.
    temps = host_values([p.temperature if p.temperature > 0 else 1.0 for p in params],
                        scores.dtype, scores.device)
    scores = scores / temps[:, None]
    # Greedy rows skip truncation too (k = 0, p = 1): no sort is spent on them.
    scores = apply_min_p(scores, [0.0 if p.is_greedy else p.min_p for p in params])
    scores = apply_top_k(scores, [0 if p.is_greedy else p.top_k for p in params])
    return apply_top_p(scores, [1.0 if p.is_greedy else p.top_p for p in params])


def _pack(chosen: torch.Tensor, raw_logprobs: torch.Tensor, finite: torch.Tensor,
          params: Sequence[SamplingParams]) -> torch.Tensor:
    """Tokens, their logprobs, the finite flags and the top-k logprobs in one float64 tensor
    (exact for token ids below 2**53), so the batch costs a single device-to-host copy."""
    k = max((p.top_logprobs for p in params), default=0)
    parts = [chosen[:, None].double(), raw_logprobs.gather(1, chosen[:, None]).double(),
             finite[:, None].double()]
    if k:
        top = raw_logprobs.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1)


def _unpack(rows: list[list[float]], params: Sequence[SamplingParams]) -> list[SampledToken]:
    k = max((p.top_logprobs for p in params), default=0)
    out: list[SampledToken] = []
    for row, p in zip(rows, params, strict=True):
        n = p.top_logprobs
        top_ids, top_vals = row[3:3 + k], row[3 + k:]
        pairs = tuple((int(top_ids[i]), top_vals[i]) for i in range(n))
        out.append(SampledToken(token_id=int(row[0]), logprob=row[1], top_logprobs=pairs,
                                finite=row[2] == 1.0))
    return out


class PendingSample:
    """A sampled batch whose host copy may still be in flight. `tokens` ([B] int64, on the
    device) can feed the next step's inputs before the host has seen them."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor,
                 params: Sequence[SamplingParams]) -> None:
        self.tokens = tokens
        self.params = list(params)
        self._event: torch.cuda.Event | None = None
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def wait(self) -> None:
        """Wait for the host copy (not for later work on the stream)."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> list[SampledToken]:
        """Wait for the host copy and unpack it."""
        self.wait()
        return _unpack(self._host.tolist(), self.params)
