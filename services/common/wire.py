"""Requests that do not decode (invalid UTF-8 in a string field, a truncated message) answer
INVALID_ARGUMENT instead of grpc's UNKNOWN.

grpc.aio calls the handler's `request_deserializer` itself and reports any exception from it as
UNKNOWN ("Unexpected <class 'DecodeError'>"), before a servicer or an error interceptor runs.
`DecodeErrorInterceptor` swaps in a deserializer that returns an `Undecodable` marker instead of
raising, and a behaviour that aborts with INVALID_ARGUMENT when it meets one. Install it on
every server that takes client input (gateway, worker, control plane).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common.names import shown


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that are not a valid message."""

    reason: str


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def call(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError) as e:
            return Undecodable(str(e))

    return call


async def _refuse(context: grpc.aio.ServicerContext, bad: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request does not decode (invalid UTF-8 in a string field?): "
                        f"{shown(bad.reason, 160)}")


def _checked_stream(requests: AsyncIterator[Any],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async def gen() -> AsyncIterator[Any]:
        async for item in requests:
            if isinstance(item, Undecodable):
                await _refuse(context, item)
            yield item

    return gen()


def _unary_in(behavior: Callable[..., Any], streaming_out: bool) -> Callable[..., Any]:
    if streaming_out:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            async for item in behavior(request, context):
                yield item
        return stream

    async def value(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)
    return value


def _stream_in(behavior: Callable[..., Any], streaming_out: bool) -> Callable[..., Any]:
    if streaming_out:
        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behavior(_checked_stream(requests, context), context):
                yield item
        return stream

    async def value(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_checked_stream(requests, context), context)
    return value


def decode_checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with undecodable requests refused as INVALID_ARGUMENT (all four RPC kinds).
    Synchronous behaviours (not used on our aio servers) are left as they are."""
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                or handler.stream_stream)
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler
    kwargs = {"request_deserializer": _safe(handler.request_deserializer),
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_unary_in(handler.unary_unary, False), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_unary_in(handler.unary_stream, True), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_stream_in(handler.stream_unary, False),
                                                    **kwargs)
    return grpc.stream_stream_rpc_method_handler(_stream_in(handler.stream_stream, True), **kwargs)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable requests -> INVALID_ARGUMENT, for every method of the server."""

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        return None if handler is None else decode_checked(handler)
