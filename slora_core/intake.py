"""Request intake: prompts tokenized and checked against the model, the arena and the queue,
then queued as a `Request`; and the outputs that end a request. Raises RequestError or
QueueFullError for what can never or cannot now be served; a refused request changes nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from slora_core.config import EngineConfig, ModelConfig
from slora_core.detokenizer import TextStream
from slora_core.outputs import RequestOutput
from slora_core.prefix_cache import base_identity, lora_identity, model_digest
from slora_core.sampler import make_generator
from slora_core.sampling_params import SamplingParams
from slora_core.scheduler import Scheduler
from slora_core.sequence import Sequence
from slora_core.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request that can never be served as asked (too long, bad ids, duplicate id)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its limit; retry later."""


class _NoText:
    """Decoder for engines without a tokenizer: every token decodes to no text."""

    def decode(self, ids: object, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class Request:
    seq: Sequence
    stream: TextStream
    generator: torch.Generator | None


class Requests:
    """The engine's live requests (queued or running), by id: intake and ends."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None, detokenize: bool, scheduler: Scheduler) -> None:
        self.model_config = model_config
        self.config = config  # resolved: max_model_len is set
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self.scheduler = scheduler
        self.live: dict[str, Request] = {}
        self.base_identity = base_identity(model_digest(model_config, config.torch_dtype))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: send token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """Refuse what no arena page count decides: id, prompt, length, queue, stop strings."""
        if request_id in self.live:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        limit = self.config.max_model_len
        assert limit is not None
        if len(ids) + params.max_new_tokens > limit:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the context length max_model_len={limit}"
            )
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests waiting")
        if not self.detokenize and params.stop:
            raise RequestError("stop strings need a detokenizing engine; this one is not")

    def pages_needed(self, seq: Sequence, adapter_pages: int) -> int:
        """Arena pages `seq` takes at its longest with an adapter of `adapter_pages`."""
        total = len(seq.prompt_token_ids) + seq.params.max_new_tokens
        return self.scheduler.blocks_for(total) + adapter_pages

    def fits_error(self, need: int, with_adapter: bool = False) -> str | None:
        """Why a request needing `need` pages can never run, or None if it fits the arena."""
        if need <= self.config.num_pages:
            return None
        what = " with its adapter" if with_adapter else ""
        return (f"the request needs {need} arena pages at its longest{what}, the arena has "
                f"{self.config.num_pages}")

    def add(self, request_id: str, ids: list[int], params: SamplingParams, *,
            adapter: str | None, adapter_name: str | None, adapter_pages: int,
            adapter_ready: bool, tenant: str, deadline_s: float | None) -> Sequence:
        """Queue a checked request (see `check`) on the adapter whose digest is `adapter`;
        RequestError if it can never fit."""
        now = time.monotonic()
        seq = Sequence(request_id, ids, params, adapter=adapter or None,
                       adapter_name=adapter_name, adapter_pages=adapter_pages, adapter_ready=adapter_ready, tenant=tenant,
                       arrival=now, deadline=None if deadline_s is None else now + deadline_s)
        error = self.fits_error(self.pages_needed(seq, adapter_pages))
        if error is not None:
            raise RequestError(error)
        if self.config.prefix_caching:  # what computes its KV: cached pages are this content's
            seq.cache_identity = lora_identity(adapter) if adapter else self.base_identity
        decoder = self.tokenizer if self.detokenize and self.tokenizer is not None else _NoText()
        stream = TextStream(decoder, ids, params.stop, min_tokens=params.min_new_tokens)
        self.live[request_id] = Request(seq, stream, make_generator(params, self.config.device))
        self.scheduler.add(seq)
        return seq

    def is_live(self, seq: Sequence) -> bool:
        """The sequence's request is still being served (not finished, aborted or failed)."""
        req = self.live.get(seq.request_id)
        return req is not None and req.seq is seq

    def end(self, req: Request, reason: str, error: str | None = None,
            error_kind: str = "") -> RequestOutput:
        """Finish `req` now (its pages freed) with `reason`; its final output."""
        self.scheduler.finish(req.seq)
        self.live.pop(req.seq.request_id, None)
        out = final_output(req, reason)
        out.error, out.error_kind = error, error_kind
        return out


def final_output(req: Request, reason: str) -> RequestOutput:
    seq = req.seq
    return RequestOutput(
        request_id=seq.request_id, text=req.stream.flush() if reason != "error" else "",
        finished=True, finish_reason=reason, prompt_tokens=len(seq.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids), cached_tokens=seq.num_cached_tokens,
    )
