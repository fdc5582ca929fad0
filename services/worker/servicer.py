"""InferenceService on a worker: convert, hand to the engine thread, stream back, convert."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping

import grpc

from services.common import errors as e
from services.common.convert import prompt_of, sampling_kwargs
from services.worker.adapters import AdapterManager
from services.worker.engine_loop import EngineLoop
from services.worker.errors import to_service_error
from services.worker.metrics import VersionKey, WorkerMetrics
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora_core.outputs import RequestOutput, merge_outputs
from slora_core.sampling_params import SamplingParams


def chunk_of(out: RequestOutput) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v)
                                      for t, v in lp.top_logprobs])
        for lp in out.logprobs
    ]
    return pb.GenerateResponse(chunk=pb.Chunk(token_ids=out.token_ids, text=out.text,
                                              logprobs=logprobs))


def coalesce(item: RequestOutput | BaseException,
             outputs: asyncio.Queue[RequestOutput | BaseException]) -> RequestOutput:
    """`item` merged with the deltas already waiting behind it: when the engine outruns the
    stream, one chunk carries several tokens instead of one message per token."""
    while True:
        if isinstance(item, BaseException):
            raise item
        if item.finished or item.error or outputs.empty():
            return item
        later = outputs.get_nowait()
        if isinstance(later, BaseException):
            raise later
        item = merge_outputs(item, later)


class WorkerServicer(pb_grpc.InferenceServiceServicer):
    """Serves explicit versions only: routing (stable/canary) is the gateway's job."""

    def __init__(self, worker_id: str, engine_loop: EngineLoop, adapters: AdapterManager,
                 metrics: WorkerMetrics,
                 slow_versions: Mapping[VersionKey, float] | None = None) -> None:
        self.worker_id = worker_id
        self.engine_loop = engine_loop
        self.adapters = adapters
        self.metrics = metrics
        # Test hook (debug_hooks.SLOW_VERSIONS_ENV): seconds to sleep before each chunk.
        self.slow_versions = dict(slow_versions or {})
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin_drain(self) -> None:
        """Refuse new requests from now on; running ones go on."""
        self.draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        key: VersionKey = (request.adapter.adapter_id, request.adapter.version)
        self.inflight += 1
        self._idle.clear()
        try:
            async for response in self._generate(request, key):
                yield response
        except (e.ServiceError, Exception) as exc:
            err = to_service_error(exc)
            if not isinstance(exc, e.Unavailable | e.ResourceExhausted):
                self.metrics.record_error(key, err.code.name)
            await e.abort_with(context, err)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def _generate(self, request: pb.GenerateRequest, key: VersionKey
                        ) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            raise e.Unavailable(f"worker {self.worker_id} is draining")
        adapter_id, version = key
        if adapter_id and not request.adapter.HasField("version"):
            raise e.InvalidArgument("workers serve explicit versions; call the gateway to route")
        prompt = prompt_of(request)
        if prompt is None:
            raise e.InvalidArgument("the request has neither text nor token_ids")
        params = SamplingParams(**sampling_kwargs(request.sampling))
        self.metrics.record_request(key)
        start = time.monotonic()
        name = await self.adapters.ensure(adapter_id, version) if adapter_id else None
        # Client ids need not be unique across gateways; the engine's must be.
        engine_id = uuid.uuid4().hex
        outputs = self.engine_loop.submit(engine_id, prompt, params, name)
        finished = nonfinite = False
        first: float | None = None
        delay = self.slow_versions.get(key, 0.0)
        try:
            while True:
                item = coalesce(await outputs.get(), outputs)
                if item.error:
                    raise e.FailedPrecondition(item.error, adapter_error=True)
                if item.token_ids or item.text:
                    if delay:
                        await asyncio.sleep(delay)
                    first = first or time.monotonic()
                    nonfinite = nonfinite or not all(math.isfinite(lp.logprob)
                                                     for lp in item.logprobs)
                    yield chunk_of(item)
                if item.finished:
                    finished = True
                    self._record_finish(key, start, first, item.completion_tokens, nonfinite)
                    yield self._complete(item, key, request.request_id)
                    return
        finally:
            if not finished:
                # Cancelled call, expired deadline or a failed write: free the pages now.
                self.engine_loop.abort(engine_id)

    def _record_finish(self, key: VersionKey, start: float, first: float | None,
                       tokens: int, nonfinite: bool) -> None:
        now = time.monotonic()
        ttft = None if first is None else first - start
        if ttft is not None:
            self.metrics.ttft.observe(ttft)
        self.metrics.record_finish(key, ttft, now - start, tokens, nonfinite)

    def _complete(self, out: RequestOutput, key: VersionKey,
                  request_id: str) -> pb.GenerateResponse:
        return pb.GenerateResponse(complete=pb.Complete(
            request_id=request_id,
            finish_reason=out.finish_reason or "stop",
            usage=pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens),
            served_by=pb.ServedBy(adapter_id=key[0], adapter_version=key[1],
                                  worker_id=self.worker_id),
        ))
