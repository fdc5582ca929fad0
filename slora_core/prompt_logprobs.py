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

import torch

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
