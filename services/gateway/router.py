"""The gateway's one routing path, below both of its protocol edges (gRPC `Generate` and the
OpenAI-compatible HTTP API): authenticate, resolve the version (sticky canary split by routing
key), pick a worker, forward with retries before the first token and the route's fallback, and
count the per-version evidence. The edges convert requests to a `GenerateRequest`, iterate a
`RoutedCall`, and turn a `ServiceError` into their own error form."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from services.common import errors as e
from services.common import hop_trace
from services.common.limits import check_generate
from services.common.resume import not_resumable, resumed_request
from services.gateway.evidence import RoutedEvidence, Served, ServedLog, check_labels
from services.gateway.metrics import GatewayMetrics
from services.gateway.mux import Upstreams
from services.gateway.siblings import Siblings
from services.gateway.table import Resolution, RoutingTable
from services.gateway.upstream import WorkerChannels
from slora.v1 import inference_pb2 as pb
from slora.v1 import placement_pb2 as ppb

log = logging.getLogger(__name__)
# Codes that mean "this worker cannot take the call now"; before the first token, the call is
# retried on the next worker.
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


# The retry hint when full workers gave none: clients back off at least this long.
BUSY_RETRY_AFTER_MS = 1000


class WorkerFailed(Exception):
    """A worker failed in a way the next one may fix: before its first message, or mid-stream
    for a request that can be resumed (`started`)."""

    def __init__(self, error: e.ServiceError, started: bool) -> None:
        super().__init__(error)
        self.error = error
        self.started = started


def all_failed(failures: list[e.ServiceError]) -> e.ServiceError:
    """The error for a call no worker took: when every worker was full, RESOURCE_EXHAUSTED with
    the shortest retry delay they asked for (the client should back off, not fail over);
    otherwise UNAVAILABLE naming the last error."""
    full = [f for f in failures if f.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    if full and len(full) == len(failures):
        delays = [f.retry_after_ms for f in full if f.retry_after_ms is not None]
        return e.ResourceExhausted(f"every worker is busy: {full[-1]}",
                                   retry_after_ms=min(delays) if delays else BUSY_RETRY_AFTER_MS)
    return e.Unavailable(f"no worker could serve the request; last error: {failures[-1]}")


class Router:
    """State shared by every call of one gateway: table, worker channels, in-flight counts,
    evidence and the served log (single-threaded: the gateway's event loop)."""

    def __init__(self, table: RoutingTable, metrics: GatewayMetrics,
                 served: ServedLog | None = None, siblings: Siblings | None = None,
                 mux_from: int | None = None) -> None:
        self.table = table
        self.siblings = siblings  # the other processes of a multi-process gateway
        self.metrics = metrics
        self.served = served or ServedLog()
        self.evidence = RoutedEvidence()
        self.inflight: dict[str, int] = {}
        self.channels = WorkerChannels()
        # One Generate call per request, or (mux_from set) one GenerateMux stream per worker
        # from that many streams in flight on it on (Upstreams).
        self.upstreams = Upstreams(self.channels, mux_from)
        self.draining = False  # set at shutdown: health reports NOT_SERVING, calls still finish
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def authenticate(self, token: str) -> ppb.KeyGrant:
        if not self.table.synced:
            raise e.Unavailable("the gateway has not received the routing table yet")
        return self.table.authenticate(token)

    def call(self, request: pb.GenerateRequest, token: str,
             timeout_s: float | None = None) -> RoutedCall:
        """One Generate call; iterate it for the responses (chunks arriving together come as
        one). Raises ServiceError from the iteration."""
        return RoutedCall(self, request, token, timeout_s)

    async def report_feedback(self, request: pb.ReportFeedbackRequest, token: str,
                              forwarded: bool = False) -> None:
        """`feedback`, or, for a request this process did not serve, the sibling process
        that did (never when the call was `forwarded` by a sibling already)."""
        try:
            self.feedback(request, token)
        except e.NotFound as missed:
            if forwarded or self.siblings is None or not request.request_id:
                raise
            await self.siblings.feedback(request, token, missed)

    def feedback(self, request: pb.ReportFeedbackRequest, token: str) -> None:
        """Charge a client's score to the version that served the request (canary evidence),
        from this process's own log."""
        grant = self.authenticate(token)
        if not request.request_id:
            raise e.InvalidArgument("request_id is required")
        if not (math.isfinite(request.score) and -1.0 <= request.score <= 1.0):
            raise e.InvalidArgument(f"score must lie in [-1, 1], got {request.score}")
        check_labels(request.labels)
        served = self.served.peek(request.request_id)
        if not grant.admin and grant.tenant != served.tenant:
            raise e.PermissionDenied(f"key {grant.key_id} may not score request "
                                     f"{request.request_id!r} of another tenant")
        self.served.claim(request.request_id)
        self.evidence.feedback((served.adapter_id, served.version), request.score,
                               dict(request.labels))

    def _enter(self) -> None:
        self._calls += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            self._idle.set()


class RoutedCall:
    """One routed Generate call. `served_by` names the version and worker from the first
    message a worker sends (before that: None); `request_id` is the caller's or a new one."""

    def __init__(self, router: Router, request: pb.GenerateRequest, token: str,
                 timeout_s: float | None) -> None:
        self.router = router
        self.request = request
        self.token = token
        self.timeout_s = timeout_s
        self.request_id = request.request_id or uuid.uuid4().hex
        # A resumed stream's worker call gets what is left of the caller's deadline.
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.served_by: pb.ServedBy | None = None
        self.caller_tenant = ""  # whose request: the worker's scheduler shares steps by it

    async def __aiter__(self) -> AsyncGenerator[pb.GenerateResponse, None]:
        router = self.router
        router._enter()
        try:
            async for r in self._route():
                yield r
            hop_trace.mark("gateway_end", self.request_id)
        except e.ServiceError as err:
            router.metrics.errors.labels(err.code.name).inc()
            raise
        finally:
            router._leave()

    async def _route(self) -> AsyncIterator[pb.GenerateResponse]:
        router, request = self.router, self.request
        hop_trace.mark("gateway_entry", self.request_id)
        grant = router.authenticate(self.token)
        self.caller_tenant = grant.tenant
        check_generate(request)
        if request.resume_token_ids:
            raise e.InvalidArgument("resume_token_ids is set by gateways only (a stream they "
                                    "resume on another worker)")
        adapter_id = request.adapter.adapter_id
        if adapter_id:
            asked = request.adapter.version if request.adapter.HasField("version") else None
            res = router.table.resolve(grant, adapter_id, asked,
                                       request.routing_key or self.request_id)
            tenant = router.table.adapters[adapter_id].tenant
        else:
            res, tenant = Resolution("", "", ""), grant.tenant
        router.metrics.requests.inc()
        key = (adapter_id, res.version)
        router.evidence.routed(key)
        first = True
        try:
            async for r in self._serve(res):
                if first and r.HasField("chunk"):
                    first = False
                    hop_trace.mark("gateway_first_out", self.request_id)
                if r.HasField("complete"):
                    hop_trace.mark("gateway_complete", self.request_id)
                    r.complete.request_id = self.request_id
                    version = r.complete.served_by.adapter_version
                    router.served.remember(self.request_id, Served(adapter_id, version, tenant))
                yield r
        except e.ServiceError as err:
            router.evidence.error(key, err.code.name)
            raise

    async def _serve(self, res: Resolution) -> AsyncIterator[pb.GenerateResponse]:
        """The routed version, or its fallback when the routed one cannot be served."""
        try:
            async for r in self._forward(res, is_fallback=False):
                yield r
        except e.ServiceError as err:
            if not (err.adapter_error and res.fallback):
                raise
            log.warning("%s@%s cannot be served (%s); falling back to %s", res.adapter_id,
                        res.version, err, res.fallback)
            self.router.metrics.fallbacks.inc()
            self.router.evidence.fallback((res.adapter_id, res.version))
            async for r in self._forward(Resolution(res.adapter_id, res.fallback, ""),
                                         is_fallback=True):
                yield r

    async def _forward(self, res: Resolution, is_fallback: bool,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(self.request)
        upstream.request_id = self.request_id
        if res.adapter_id:
            upstream.adapter.version = res.version
        workers = self.router.table.candidates(res.adapter_id, res.version, self.router.inflight)
        if not workers:
            raise e.Unavailable("no worker is available")
        failures: list[e.ServiceError] = []
        emitted: list[int] = []  # the tokens the client has: a resumed stream goes on after them
        for attempt, worker in enumerate(workers):
            if attempt:
                self.router.metrics.retries.inc()
            call = resumed_request(upstream, emitted) if emitted else upstream
            try:
                async for r in self._call(worker, call, is_fallback):
                    if r.HasField("chunk"):
                        emitted.extend(r.chunk.token_ids)
                    yield r
                return
            except WorkerFailed as exc:
                failures.append(exc.error)
                if exc.started:
                    self.router.metrics.resumed.inc()
                log.info("worker %s failed %s: %s", worker.worker_id,
                         f"after {len(emitted)} tokens; resuming the stream on the next worker"
                         if exc.started else "before the first token", exc.error)
        raise all_failed(failures)

    async def _call(self, worker: ppb.WorkerEndpoint, upstream: pb.GenerateRequest,
                    is_fallback: bool) -> AsyncIterator[pb.GenerateResponse]:
        """Stream from one worker. Raises WorkerFailed when it fails (dies, drops the stream)
        before its first message, or later when the request can be resumed elsewhere
        (docs/failover.md); a ServiceError for the caller otherwise."""
        inflight = self.router.inflight
        call = self.router.upstreams.open(worker.address, upstream, self.caller_tenant,
                                          self.deadline, inflight.get(worker.worker_id, 0))
        inflight[worker.worker_id] = inflight.get(worker.worker_id, 0) + 1
        started = False
        try:
            async for batch in call.batches():
                if batch and batch[-1].HasField("complete"):  # before the chunks' writes
                    hop_trace.mark("gateway_complete_in", upstream.request_id)
                if not started:
                    started = True
                    hop_trace.mark("gateway_first_in", upstream.request_id)
                    self.served_by = pb.ServedBy(
                        adapter_id=upstream.adapter.adapter_id,
                        adapter_version=upstream.adapter.version, is_fallback=is_fallback,
                        worker_id=worker.worker_id)
                for r in batch:
                    if r.HasField("complete"):
                        r.complete.served_by.is_fallback = is_fallback
                    yield r
        except grpc.aio.AioRpcError as exc:
            err = e.error_from_rpc(exc)
            # A deterministic error (bad token ids, non-finite logits) would recur on every
            # worker: the client gets it now.
            if exc.code() in RETRY_CODES and not err.deterministic and (
                    not started or not not_resumable(upstream)):
                raise WorkerFailed(err, started) from None
            raise err from None
        finally:
            inflight[worker.worker_id] -= 1
            # A client cancel or deadline ends this generator early: `batches()` cancels the
            # worker call (or sends the mux a cancel) so the worker frees the request's pages
            # at once.
