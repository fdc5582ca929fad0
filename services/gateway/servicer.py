"""InferenceService on the gateway: authenticate, resolve, pick a worker, forward the stream."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator

import grpc

from services.common import errors as e
from services.common.cluster_token import bearer_token
from services.common.server import CHANNEL_OPTIONS
from services.gateway.evidence import RoutedEvidence, Served, ServedLog, check_labels
from services.gateway.metrics import GatewayMetrics
from services.gateway.table import Resolution, RoutingTable
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc
from slora.v1 import placement_pb2 as ppb

log = logging.getLogger(__name__)
# Codes that mean "this worker cannot take the call now"; before the first token, the call is
# retried on the next worker.
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


class WorkerFailed(Exception):
    """A worker failed before sending a token; the next one may be tried."""


class GatewayServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, table: RoutingTable, metrics: GatewayMetrics,
                 served: ServedLog | None = None) -> None:
        self.table = table
        self.metrics = metrics
        self.served = served or ServedLog()
        self.evidence = RoutedEvidence()
        self.inflight: dict[str, int] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _stub(self, address: str) -> pb_grpc.InferenceServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return pb_grpc.InferenceServiceStub(channel)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        self._calls += 1
        self._idle.clear()
        try:
            async for response in self._generate(request, context):
                yield response
        except e.ServiceError as err:
            self.metrics.errors.labels(err.code.name).inc()
            await e.abort_with(context, err)
        finally:
            self._calls -= 1
            if self._calls == 0:
                self._idle.set()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.GenerateResponse]:
        if not self.table.synced:
            raise e.Unavailable("the gateway has not received the routing table yet")
        grant = self.table.authenticate(bearer_token(context.invocation_metadata()))
        request_id = request.request_id or uuid.uuid4().hex
        adapter_id = request.adapter.adapter_id
        if adapter_id:
            asked = request.adapter.version if request.adapter.HasField("version") else None
            res = self.table.resolve(grant, adapter_id, asked, request.routing_key or request_id)
            tenant = self.table.adapters[adapter_id].tenant
        else:
            res, tenant = Resolution("", "", ""), grant.tenant
        self.metrics.requests.inc()
        key = (adapter_id, res.version)
        self.evidence.routed(key)
        try:
            async for r in self._serve(request, request_id, res, context):
                if r.HasField("complete"):
                    r.complete.request_id = request_id
                    by = r.complete.served_by
                    self.served.remember(request_id, Served(adapter_id, by.adapter_version, tenant))
                yield r
        except e.ServiceError as err:
            self.evidence.error(key, err.code.name)
            raise

    async def _serve(self, request: pb.GenerateRequest, request_id: str, res: Resolution,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """The routed version, or its fallback when the routed one cannot be served."""
        try:
            async for r in self._forward(request, request_id, res, context, is_fallback=False):
                yield r
        except e.ServiceError as err:
            if not (err.adapter_error and res.fallback):
                raise
            log.warning("%s@%s cannot be served (%s); falling back to %s", res.adapter_id,
                        res.version, err, res.fallback)
            self.metrics.fallbacks.inc()
            self.evidence.fallback((res.adapter_id, res.version))
            fallback = Resolution(res.adapter_id, res.fallback, "")
            async for r in self._forward(request, request_id, fallback, context, is_fallback=True):
                yield r

    async def ReportFeedback(self, request: pb.ReportFeedbackRequest,
                             context: grpc.aio.ServicerContext) -> pb.ReportFeedbackResponse:
        """Charge a client's score to the version that served the request (canary evidence)."""
        try:
            self._feedback(request, bearer_token(context.invocation_metadata()))
        except e.ServiceError as err:
            await e.abort_with(context, err)
        return pb.ReportFeedbackResponse()

    def _feedback(self, request: pb.ReportFeedbackRequest, token: str) -> None:
        if not self.table.synced:
            raise e.Unavailable("the gateway has not received the routing table yet")
        grant = self.table.authenticate(token)
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

    async def _forward(self, request: pb.GenerateRequest, request_id: str, res: Resolution,
                       context: grpc.aio.ServicerContext, is_fallback: bool,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        upstream = pb.GenerateRequest()
        upstream.CopyFrom(request)
        upstream.request_id = request_id
        if res.adapter_id:
            upstream.adapter.version = res.version
        workers = self.table.candidates(res.adapter_id, res.version, self.inflight)
        if not workers:
            raise e.Unavailable("no worker is available")
        last: e.ServiceError | None = None
        for attempt, worker in enumerate(workers):
            if attempt:
                self.metrics.retries.inc()
            try:
                async for r in self._call(worker, upstream, context, is_fallback):
                    yield r
                return
            except WorkerFailed as exc:
                last = exc.args[0]
                log.info("worker %s failed before the first token: %s", worker.worker_id, last)
        raise e.Unavailable(f"no worker could serve the request; last error: {last}")

    async def _call(self, worker: ppb.WorkerEndpoint, upstream: pb.GenerateRequest,
                    context: grpc.aio.ServicerContext, is_fallback: bool,
                    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream from one worker. Raises WorkerFailed when it fails before the first token,
        a ServiceError for the caller otherwise."""
        remaining = context.time_remaining()
        call = self._stub(worker.address).Generate(upstream, timeout=remaining)
        started = False
        self.inflight[worker.worker_id] = self.inflight.get(worker.worker_id, 0) + 1
        try:
            async for r in call:
                if r.HasField("complete"):
                    r.complete.served_by.is_fallback = is_fallback
                started = started or r.HasField("chunk")
                yield r
        except grpc.aio.AioRpcError as exc:
            err = e.error_from_rpc(exc)
            if not started and exc.code() in RETRY_CODES:
                raise WorkerFailed(err) from None
            raise err from None
        finally:
            self.inflight[worker.worker_id] -= 1
            # A client cancel or deadline ends this generator early: cancel upstream so the
            # worker frees the request's pages at once.
            call.cancel()
