"""InferenceService on the gateway: the gRPC edge of the routing path in `router.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common import errors as e
from services.common.cluster_token import bearer_token
from services.gateway.router import Router
from services.gateway.siblings import is_forwarded
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc


class GatewayServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        token = bearer_token(context.invocation_metadata())
        try:
            async for r in self.router.call(request, token, context.time_remaining()):
                yield r
        except e.ServiceError as err:
            await e.abort_with(context, err)

    async def ReportFeedback(self, request: pb.ReportFeedbackRequest,
                             context: grpc.aio.ServicerContext) -> pb.ReportFeedbackResponse:
        """Charge a client's score to the version that served the request (canary evidence)."""
        md = context.invocation_metadata()
        try:
            await self.router.report_feedback(request, bearer_token(md), is_forwarded(md))
        except e.ServiceError as err:
            await e.abort_with(context, err)
        return pb.ReportFeedbackResponse()
