"""Prompt logprobs from prefill hidden states, in passes of a few rows, against the whole
[len, vocab] log-softmax computed at once."""

from __future__ import annotations

import pytest
import torch

from slora_core.prompt_logprobs import prompt_logprobs


def _head(vocab: int = 50, hidden: int = 16) -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    return head, torch.randn(40, hidden)


@pytest.mark.parametrize(("rows", "k"), [(1, 0), (7, 3), (256, 5)])
def test_passes_equal_the_whole_log_softmax(rows: int, k: int) -> None:
    head, hidden = _head()
    targets = torch.randint(0, 50, (37,)).tolist()  # the last 3 rows predict past the prompt
    seen: list[int] = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        return head(h)

    got = prompt_logprobs(hidden, logits, targets, k, rows_per_pass=rows)
    full = torch.log_softmax(head(hidden[:37]).double(), dim=-1)
    assert max(seen) <= rows and sum(seen) == 37  # never more than a pass of rows at once
    for i, p in enumerate(got):
        assert p.token_id == targets[i]
        assert abs(p.logprob - float(full[i, targets[i]])) < 1e-5
        top = full[i].topk(k)
        assert [t for t, _ in p.top_logprobs] == top.indices.tolist()
        assert all(abs(v - w) < 1e-5 for (_, v), w in zip(p.top_logprobs, top.values.tolist(),
                                                           strict=True))


def test_more_targets_than_rows_is_refused() -> None:
    head, hidden = _head()
    with pytest.raises(ValueError, match="41 targets but 40 hidden rows"):
        prompt_logprobs(hidden, head, [0] * 41, 0)


def test_chunked_prefill_scores_every_prompt_token_once() -> None:
    from slora_core.prompt_logprobs import score_step, wants_prompt_logprobs
    from slora_core.sampling_params import SamplingParams
    from slora_core.scheduler import ScheduledSeq
    from slora_core.sequence import Sequence

    head, hidden = _head()
    prompt = torch.randint(0, 50, (23,)).tolist()
    seq = Sequence("a", prompt, SamplingParams(prompt_logprobs=2))
    other = Sequence("b", [1, 2, 3], SamplingParams())
    full = torch.log_softmax(head(hidden[:23]).double(), dim=-1)
    got = []
    for start, n in ((0, 10), (10, 13)):  # two chunks; `other` decodes beside the second
        seq.num_computed_tokens = start
        step = [ScheduledSeq(other, 1), ScheduledSeq(seq, n)]
        rows = torch.cat([torch.zeros(1, 16), hidden[start:start + n]])
        assert wants_prompt_logprobs(step)
        scored = score_step(step, [0, 1], rows, head)
        assert set(scored) == {"a"} and scored["a"][0] == start + 1
        got += scored["a"][1]
    assert [p.token_id for p in got] == prompt[1:]
    for i, p in enumerate(got):
        assert abs(p.logprob - float(full[i, prompt[i + 1]])) < 1e-5 and len(p.top_logprobs) == 2
    seq.num_computed_tokens = 23
    assert not wants_prompt_logprobs([ScheduledSeq(seq, 1)])
