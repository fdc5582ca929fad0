"""A stream resumed on this worker after another failed mid-generation (docs/failover.md).

The gateway sends the original request plus `resume_token_ids`, the tokens the client already
has. This worker generates what the first one would have generated after them: the engine gets
the prompt followed by those tokens, with the token budget left, and a seeded request's draws
moved on by as many positions (`slora_core.sampler.advance_seed`: its draws are a function of
(seed, position)); greedy output is a function of the context alone. The detokenizer replays
the tokens without sending their text again, so text it was holding back (a possible stop
string, an unfinished character) comes out as it would have.
"""

from __future__ import annotations

import dataclasses

from services.common import errors as e
from services.common.resume import not_resumable
from slora.v1 import inference_pb2 as pb
from slora_core.sampler import advance_seed
from slora_core.sampling_params import SamplingParams


def resumed_params(request: pb.GenerateRequest, params: SamplingParams,
                   resume: list[int]) -> SamplingParams | None:
    """The engine's parameters for the rest of a stream after `resume` tokens; None when the
    budget is spent (the stream ends with "length" at once). Raises FailedPrecondition for a
    request that cannot resume, InvalidArgument for more tokens than it may generate."""
    why = not_resumable(request)
    if why:
        raise e.FailedPrecondition(f"a request with {why} cannot be resumed",
                                   deterministic=True)
    n = len(resume)
    if n > params.max_new_tokens:
        raise e.InvalidArgument(f"{n} resumed tokens exceed max_new_tokens "
                                f"{params.max_new_tokens}", deterministic=True)
    if n == params.max_new_tokens:
        return None
    seed = None if params.seed is None else advance_seed(params.seed, n)
    return dataclasses.replace(params, max_new_tokens=params.max_new_tokens - n,
                               min_new_tokens=max(0, params.min_new_tokens - n), seed=seed)


def resumed_end(resume: list[int], params: SamplingParams, eos_token_ids: list[int],
                stopped: bool) -> str | None:
    """The finish reason of a stream whose resumed tokens already end it (its first worker
    finished, but the end never reached the gateway): a stop string (`stopped`), a stop token
    or end-of-sequence token last, or the budget spent; None when it goes on."""
    if not resume:
        return None
    last = resume[-1]
    if stopped or last in params.stop_token_ids or (
            not params.ignore_eos and last in eos_token_ids):
        return "stop"
    return "length" if len(resume) >= params.max_new_tokens else None
