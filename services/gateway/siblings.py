"""The other processes of one multi-process gateway (supervisor.py), for what a process cannot
answer alone: feedback naming a request another process served.

Each process remembers only the requests it served (`ServedLog`), and the kernel gives a
feedback call's connection to any of them. A process that does not know the request asks its
siblings, over their Unix sockets in the supervisor's private folder, with the caller's own key
(each sibling authenticates it again) and a mark that stops the call from being forwarded again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from services.common import errors as e
from services.common.cluster_token import cluster_metadata
from slora.v1 import inference_pb2 as pb
from slora.v1 import inference_pb2_grpc as pb_grpc

# Set on a call one process forwards to another: the receiver answers from its own log only.
FORWARDED_HEADER = "x-slora-forwarded"
FEEDBACK_TIMEOUT_S = 5.0


def is_forwarded(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    return any(k == FORWARDED_HEADER for k, _v in metadata or ())


def socket_target(path: str) -> str:
    return f"unix:{path}"


class Siblings:
    """Channels to the other processes' Unix sockets, opened at first use."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self.sockets = list(sockets)
        self._stubs: dict[str, pb_grpc.InferenceServiceStub] = {}

    def _stub(self, path: str) -> pb_grpc.InferenceServiceStub:
        stub = self._stubs.get(path)
        if stub is None:
            stub = pb_grpc.InferenceServiceStub(grpc.aio.insecure_channel(socket_target(path)))
            self._stubs[path] = stub
        return stub

    async def feedback(self, request: pb.ReportFeedbackRequest, token: str,
                       missed: e.NotFound) -> None:
        """Give the feedback to the sibling that served the request. Raises `missed` when
        none did, or the error of the one that knew it (already scored, another tenant's). A
        sibling not listening yet (or any more) cannot have served it: skipped."""
        md = (*cluster_metadata(token), (FORWARDED_HEADER, "1"))
        for path in self.sockets:
            try:
                await self._stub(path).ReportFeedback(request, metadata=md,
                                                      timeout=FEEDBACK_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    raise e.error_from_rpc(exc) from None
        raise missed
