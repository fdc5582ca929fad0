"""InferenceService on a worker's front: convert, tokenize, hand to the engine core, stream back.

The front does everything per request that is not the step loop: tokenization, incremental
detokenization and stop strings (`TextStream`), per-request streams, metrics. A stop string is
matched here; the request is then aborted in the core (which may have computed a token or two
more, dropped here).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import grpc

from services.common import errors as e
from services.common import hop_trace
from services.common.convert import (
    add_token_logprobs,
    chat_prompt_ids,
    first_chunk,
    fit_to_prompt,
    prompt_of,
    sampling_kwargs,
)
from services.common.hop_auth import TENANT_HEADER
from services.common.limits import check_generate, check_token_ids
from services.common.structured import from_pb
from services.common.versions import VersionKey
from services.worker import core_protocol as m
from services.worker.adapters import AdapterManager
from services.worker.core_client import CoreClient, TokenStream, error_of
from services.worker.errors import to_service_error
from services.worker.metrics import WorkerMetrics
from services.worker.mux import PUMP_BUDGET_S, MuxSession
from services.worker.resume import resumed_end, resumed_params
from services.worker.token_text import TokenText
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora_core.chat_template import ChatTemplateError
from slora_core.detokenizer import TextStream
from slora_core.outputs import NONFINITE
from slora_core.sampling_params import SamplingParams
from slora_core.tokenizer import Tokenizer

# Prompts longer than this many bytes are tokenized on a thread, so one huge prompt does not
# stall every other stream on the event loop.
INLINE_TOKENIZE_BYTES = 4096


class NonfiniteFailure(e.Internal):
    """The engine ended the request because its logits were NaN or inf: the same request on
    another worker (same model, same adapter version) would meet them too."""

    def __init__(self, message: str) -> None:
        super().__init__(message, deterministic=True)


# Codes that say "this worker cannot take the request now", not "this request cannot be
# served": they stay retryable when raised while the request is being built.
WORKER_STATE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class Delta:
    """What one chunk carries: new tokens, their logprobs, the text they released."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    text: str


def fill_chunk(chunk: pb.Chunk, d: Delta, text_of: TokenText) -> None:
    """Write `d` into an empty chunk, in place (see `Served.pump_into`)."""
    chunk.token_ids.extend(d.token_ids)
    chunk.text = d.text
    add_token_logprobs(chunk.logprobs, text_of.of, d.token_ids, d.logprobs, d.top or None)


class Detokenized:
    """A request's TokenStream turned into deltas: text released by TextStream, tokens cut at
    a matched stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                 tokens: TokenStream) -> None:
        self.text = TextStream(tokenizer, prompt_ids, params.stop,
                               skip_special_tokens=params.skip_special_tokens,
                               min_tokens=params.min_new_tokens)
        self.include_stop = params.include_stop_str_in_output
        self.tokens = tokens
        self.completion_tokens = 0
        self.stopped = False

    def replay(self, token_ids: list[int]) -> None:
        """Take tokens the client already has (a resumed stream): their text is not sent again,
        and what the detokenizer holds back after them comes out as it would have."""
        for tok in token_ids:
            self.text.append(tok)
        self.completion_tokens += len(token_ids)
        self.stopped = self.text.stopped  # the first worker matched a stop string at the end

    def end_text(self) -> str:
        """The text a stream that ends now still sends (as `next` would at its end)."""
        stop = self.text.stop_string if self.stopped and self.include_stop else ""
        return stop + self.text.flush()

    def ready(self) -> bool:
        """Tokens or the end arrived since the last `take`."""
        return bool(self.tokens.token_ids) or self.tokens.finish is not None

    def take(self) -> tuple[Delta, m.Finish | None]:
        """The tokens that arrived since the last call (none: an empty delta)."""
        s = self.tokens
        ids, lps, top = s.take()
        pieces = []
        for n, tok in enumerate(ids, 1):
            pieces.append(self.text.append(tok))
            if self.text.stopped:  # this token completed a stop string: the rest is dropped
                if self.include_stop:
                    pieces.append(self.text.stop_string)
                ids, lps, top = ids[:n], lps[:n], top[:n]
                self.stopped = True
                break
        self.completion_tokens += len(ids)
        finish = s.finish
        if self.stopped:
            finish = m.Finish(0, "stop")
        if finish is not None and not finish.code:
            pieces.append(self.text.flush())
        return Delta(ids, lps, top, "".join(pieces)), finish


class WorkerServicer(pb_grpc.InferenceServiceServicer):
    """Serves explicit versions only: routing (stable/canary) is the gateway's job."""

    def __init__(self, worker_id: str, core: CoreClient, tokenizer: Tokenizer,
                 adapters: AdapterManager, metrics: WorkerMetrics,
                 slow_versions: Mapping[VersionKey, float] | None = None,
                 vocab_size: int | None = None, mux_pump_s: float = PUMP_BUDGET_S) -> None:
        self.worker_id = worker_id
        self.mux_pump_s = mux_pump_s  # MuxSession.pump_budget_s
        # The model's vocabulary: prompt ids at or past it are refused before they reach the
        # detokenizer or the engine (None: the tokenizer's own size).
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.vocab_size
        self.token_text = TokenText(tokenizer.backend)  # logprobs' token text and bytes
        self.core = core
        self.tokenizer = tokenizer
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
        tenant = next((v for k, v in context.invocation_metadata() or ()
                       if k == TENANT_HEADER), "")
        try:
            async for response in self.serve(request, str(tenant), context.time_remaining()):
                yield response
        except e.ServiceError as err:
            await e.abort_with(context, err)

    async def GenerateMux(self, request_iterator: AsyncIterator[pb.MuxUp],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxDown]:
        """A gateway's requests over one stream, each taken by `open` as Generate's is; the
        mux's writer builds their responses as tokens arrive, without a task a stream."""
        session = MuxSession(self.serve, self.open)
        session.pump_budget_s = self.mux_pump_s
        async for frame in session.frames(request_iterator):
            yield frame

    async def serve(self, request: pb.GenerateRequest, tenant: str,
                    time_remaining: float | None) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One request in a task of its own (a per-call Generate): its responses, or the
        ServiceError it ends with (counted in the metrics). Closing it early (a cancel) frees
        it in the core."""
        served = await self.open(request, tenant, time_remaining)
        try:
            while True:
                for response in served.pump():
                    yield response
                if served.done:
                    return
                await served.wait()
                if served.delay:  # the test hook: before the chunk is built
                    await asyncio.sleep(served.delay)
        finally:
            served.close()

    async def open(self, request: pb.GenerateRequest, tenant: str,
                   time_remaining: float | None) -> Served:
        """Take a request (checks, tokenizing, its adapter, the hand-over to the core) and
        return what builds its responses; raises the ServiceError it fails with (counted).
        `tenant`: the caller's, from the gateway (the scheduler shares steps fairly by it);
        `time_remaining`: the call's deadline, after which an unscheduled request is dropped."""
        served = Served(self, request)
        hop_trace.mark("worker_entry", request.request_id)
        self.inflight += 1
        self._idle.clear()
        try:
            await served.start(tenant, time_remaining)
        except BaseException as exc:
            served.close()
            if isinstance(exc, Exception):
                raise served.failed(exc) from None
            raise
        return served

    def _release(self) -> None:
        """A request taken by `open` has ended (Served.close)."""
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        prompt = prompt_of(request)
        if request.messages:
            if prompt is not None:
                raise e.InvalidArgument("send either messages or text/token_ids, not both")
            try:
                return await asyncio.to_thread(chat_prompt_ids, self.tokenizer, request)
            except ChatTemplateError as exc:
                raise e.InvalidArgument(str(exc)) from None
        if prompt is None:
            raise e.InvalidArgument("the request has neither text, token_ids nor messages")
        if not isinstance(prompt, str):
            return prompt
        if len(prompt) > INLINE_TOKENIZE_BYTES:
            return await asyncio.to_thread(self.tokenizer.encode, prompt)
        return self.tokenizer.encode(prompt)

    def _eos_token_ids(self) -> list[int]:
        ready = getattr(self.core, "ready", None)  # test doubles may lack it
        return list(ready.eos_token_ids) if ready is not None else []

    def _max_model_len(self) -> int:
        ready = getattr(self.core, "ready", None)  # test doubles may lack it
        return ready.max_model_len if ready is not None else 2**31 - 1


class Served:
    """One request the worker has taken, from the hand-over to its end. `pump` turns what
    arrived from the core since the last pump into responses, without waiting: a per-call
    Generate awaits `wait` between pumps in its own task (`WorkerServicer.serve`), a
    GenerateMux's writer pumps every stream with news in one pass (services/worker/mux.py),
    which spares each stream a task wake and a generator chain a step. `close` frees what it
    holds, once, whatever ended it."""

    def __init__(self, front: WorkerServicer, request: pb.GenerateRequest) -> None:
        self.front = front
        self.request = request
        self.key: VersionKey = (request.adapter.adapter_id, request.adapter.version)
        # Test hook (debug_hooks.SLOW_VERSIONS_ENV): seconds to wait before each chunk.
        self.delay = front.slow_versions.get(self.key, 0.0)
        self.done = False  # the last response was pumped (or the request failed)
        self.rid: int | None = None  # the core's id once handed over
        self._stream: Detokenized | None = None
        self._ids: list[int] = []  # the client's prompt
        self._resumed = False
        self._pending: list[pb.GenerateResponse] = []  # a stream resumed past its end
        self._start = 0.0
        self._first: float | None = None
        self._nonfinite = False
        self._closed = False

    async def start(self, tenant: str, time_remaining: float | None) -> None:
        front, request = self.front, self.request
        if front.draining:
            raise e.Unavailable(f"worker {front.worker_id} is draining")
        adapter_id, version = self.key
        if adapter_id and not request.adapter.HasField("version"):
            raise e.InvalidArgument("workers serve explicit versions; call the gateway to route")
        try:
            check_generate(request)  # caps on stops, prompt bytes, names: before tokenizing
            params = SamplingParams(**sampling_kwargs(request.sampling))
            structured = from_pb(request.structured_output)  # checked here; compiled in the core
            ids = await front._prompt_ids(request)
            check_token_ids(ids, front.vocab_size)
            params = fit_to_prompt(params, request.sampling, len(ids), front._max_model_len(),
                                   front.vocab_size)
            # Built before the engine gets the request: the detokenizer decodes the prompt's
            # tail, and what fails there must fail before anything is taken.
            stream = Detokenized(front.tokenizer, ids, params, TokenStream())
            resume = list(request.resume_token_ids)  # a stream resumed here (resume.py)
            check_token_ids(resume, front.vocab_size)
            left = resumed_params(request, params, resume) if resume else params
            stream.replay(resume)
            # The first worker had finished, only its end never arrived.
            end = resumed_end(resume, params, front._eos_token_ids(), stream.stopped)
        except Exception as exc:
            # Nothing is taken yet; a request that cannot be built here cannot be built on
            # any worker, so the gateway must not try the next one.
            err = to_service_error(exc)
            if err.code not in WORKER_STATE_CODES:
                err.deterministic = True
            raise err from None
        front.metrics.record_request(self.key)
        self._start = time.monotonic()
        name = await front.adapters.ensure(adapter_id, version) if adapter_id else None
        self._stream, self._ids, self._resumed = stream, ids, bool(resume)
        if end is not None or left is None:  # resumed past its end: send just the end
            held = stream.end_text()  # text the detokenizer still held back
            if held:
                self._pending.append(pb.GenerateResponse(chunk=pb.Chunk(text=held)))
            self._pending.append(pb.GenerateResponse())
            self._complete(self._pending[-1], end or "length")
            return
        # Timed before the hand-over: the core may mark core_added before add returns.
        handed = time.time()
        self.rid, stream.tokens = front.core.add(ids + resume, left, name, tenant=tenant,
                                                 deadline_s=time_remaining,
                                                 structured=structured)
        hop_trace.mark("worker_added", f"{request.request_id}:{self.rid}", handed)

    def has_news(self) -> bool:
        return bool(self._pending) or (self._stream is not None and not self.done
                                       and self._stream.ready())

    async def wait(self) -> None:
        """Until `pump` has something (returns at once when it has)."""
        if self._stream is None or self.has_news():
            return
        # An event left set with nothing to pump (a wake whose tokens a pump took first)
        # would return at once, again and again, and the loop would never turn.
        event = self._stream.tokens.event
        event.clear()
        await event.wait()

    def listen(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever `pump` has news (now, if it has some already); the test hook's
        delay postpones each wake."""
        if self.delay:
            loop, delay, now = asyncio.get_running_loop(), self.delay, wake

            def wake() -> None:
                loop.call_later(delay, now)
        if self._stream is not None:
            self._stream.tokens.listener = wake
        if self.has_news():
            wake()

    def pump(self) -> list[pb.GenerateResponse]:
        """The responses for what arrived since the last pump (often one chunk); the last is
        the `complete`, after which `done` is set. Raises the ServiceError the request ends
        with (counted in the metrics)."""
        out: list[pb.GenerateResponse] = []

        def new() -> pb.GenerateResponse:
            out.append(pb.GenerateResponse())
            return out[-1]
        self.pump_into(new)
        return out

    def pump_into(self, new: Callable[[], pb.GenerateResponse]) -> None:
        """`pump`, each response written in place into the empty message `new()` gives (a mux
        frame's next item: no copy is made). Raises as `pump` does."""
        try:
            self._pump(new)
        except Exception as exc:
            self.done = True
            raise self.failed(exc) from None

    def _pump(self, new: Callable[[], pb.GenerateResponse]) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self.done = True
            for r in pending:
                new().CopyFrom(r)
            return
        stream, front, request = self._stream, self.front, self.request
        if stream is None or self.done or not stream.ready():
            return
        delta, finish = stream.take()
        if finish is not None and finish.code:
            if finish.kind == NONFINITE:
                raise NonfiniteFailure(finish.error)
            raise error_of(finish.code, finish.error, finish.adapter_error)
        if delta.token_ids or delta.text:
            self._nonfinite = self._nonfinite or not all(map(math.isfinite, delta.logprobs))
            chunk = new().chunk
            fill_chunk(chunk, delta, front.token_text)
            if self._first is None and not self._resumed:  # a resumed client has it
                first_chunk(chunk, request, self._ids, front.tokenizer.decode,
                            stream.tokens.prompt, front.token_text.of)
            if self._first is None:
                hop_trace.mark("worker_first_out", request.request_id)
                self._first = time.monotonic()
        if finish is not None:
            self.done = True
            self._record_finish()
            hop_trace.mark("worker_complete", request.request_id)
            # A resumed stream's engine prompt also held the tokens replayed after the
            # client's prompt: only the client's prompt counts as cached.
            self._complete(new(), finish.reason, min(stream.tokens.cached_tokens, len(self._ids)))

    def _record_finish(self) -> None:
        assert self._stream is not None
        metrics, start = self.front.metrics, self._start
        ttft = None if self._first is None else self._first - start
        if ttft is not None:
            metrics.ttft.observe(ttft)
        metrics.record_finish(self.key, ttft, time.monotonic() - start,
                              self._stream.completion_tokens, self._nonfinite)

    def _complete(self, into: pb.GenerateResponse, reason: str, cached_tokens: int = 0) -> None:
        """Write the request's last response into `into`: why it ended, its usage, who served
        it."""
        assert self._stream is not None
        done = into.complete
        done.request_id, done.finish_reason = self.request.request_id, reason
        done.usage.prompt_tokens = len(self._ids)
        done.usage.completion_tokens = self._stream.completion_tokens
        done.usage.cached_tokens = cached_tokens
        done.served_by.adapter_id, done.served_by.adapter_version = self.key
        done.served_by.worker_id = self.front.worker_id

    def failed(self, exc: Exception) -> e.ServiceError:
        """The ServiceError `exc` ends the request with, counted in the metrics."""
        err = to_service_error(exc)
        if isinstance(exc, NonfiniteFailure):
            # Counted once, as a non-finite output (canary evidence counts it a failure).
            self.front.metrics.record_nonfinite_failure(self.key)
        elif err.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
            self.front.metrics.record_error(self.key, err.code.name)
        return err

    def close(self) -> None:
        """Free what the request holds, once: a cancelled call, an expired deadline, a failed
        write or a stop string frees its pages in the core now (a no-op for a request the core
        already finished)."""
        if self._closed:
            return
        self._closed = True
        stream = self._stream
        if stream is not None:
            stream.tokens.listener = None
        if self.rid is not None and self.front.core.abort(self.rid) and not (
                stream is not None and stream.stopped):
            self.front.metrics.aborts.inc()
        self.front._release()
