"""Log-probabilities of a prompt's own tokens, computed from the hidden states of its prefill.

Position i's hidden state predicts token i + 1, so a prefill chunk of positions [s, e) scores
the prompt tokens s + 1 .. e (the last of them is the first token of the next chunk, or the
first generated token's position when the chunk ends the prompt: not a prompt token, skipped).
The LM head runs over at most `rows_per_pass` positions at a time, so a long prompt never
holds a [len, vocab] tensor: peak extra memory is rows_per_pass x vocab floats. One
device-to-host copy per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slora_core.scheduler import ScheduledSeq

ROWS_PER_PASS = 256  # 256 x 128k vocab x 4 bytes = 128 MiB at most, per pass


@dataclass(frozen=True)
class PromptLogprob:
    """The logprob of prompt token `token_id` and the `k` most likely tokens at its position."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    targets: Sequence[int], k: int, rows_per_pass: int = ROWS_PER_PASS,
                    ) -> list[PromptLogprob]:
    """`hidden` [n, H]: the chunk's hidden states; `targets[i]`: the prompt token position i
    predicts (len(targets) <= n: positions past the prompt's end are not scored);
    `compute_logits` maps [m, H] to float32 logits [m, V]. Returns one PromptLogprob per
    target, with the top `k` (token, logprob) pairs, best first."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n = len(targets)
    if n > hidden.shape[0]:
        raise ValueError(f"{n} targets but {hidden.shape[0]} hidden rows")
    out: list[PromptLogprob] = []
    for start in range(0, n, rows_per_pass):
        stop = min(n, start + rows_per_pass)
        logprobs = torch.log_softmax(compute_logits(hidden[start:stop]).float(), dim=-1)
        ids = torch.tensor(targets[start:stop], dtype=torch.long, device=logprobs.device)
        parts = [logprobs.gather(1, ids[:, None]).double()]
        if k:
            top = logprobs.topk(k, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        rows = torch.cat(parts, dim=1).cpu().tolist()
        for target, row in zip(targets[start:stop], rows, strict=True):
            pairs = tuple((int(row[1 + j]), row[1 + k + j]) for j in range(k))
            out.append(PromptLogprob(int(target), row[0], pairs))
    return out


def wants_prompt_logprobs(scheduled: Sequence[ScheduledSeq]) -> bool:
    """Some sequence of the step asked for prompt logprobs and prefills part of its prompt."""
    return any(s.seq.params.prompt_logprobs is not None
               and s.seq.num_computed_tokens < len(s.seq.prompt_token_ids) for s in scheduled)


def score_step(scheduled: Sequence[ScheduledSeq], query_starts: Sequence[int],
               hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
               ) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """Per request id that asked for them: (the first prompt position scored, the logprobs of
    the prompt tokens this step's prefill chunk predicts). `query_starts[i]` is the first row
    of `scheduled[i]` in `hidden` (the step's flattened tokens)."""
    out: dict[str, tuple[int, list[PromptLogprob]]] = {}
    for i, item in enumerate(scheduled):
        seq = item.seq
        k = seq.params.prompt_logprobs
        prompt = len(seq.prompt_token_ids)
        start = seq.num_computed_tokens
        if k is None or start >= prompt:
            continue
        end = min(start + item.num_new_tokens, prompt - 1)  # the last prompt row predicts output
        targets = seq.prompt_token_ids[start + 1:end + 1]
        row = int(query_starts[i])
        scores = prompt_logprobs(hidden[row:row + len(targets)], compute_logits, targets, k)
        out[seq.request_id] = (start + 1, scores)
    return out
