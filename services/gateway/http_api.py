"""The gateway's OpenAI-compatible HTTP API (FastAPI), on the same routing path as gRPC
`Generate`: `/v1/completions`, `/v1/chat/completions` (streaming as server-sent events, or
not), `/v1/models`, `/v1/feedback`, plus `/health` and `/metrics`.

Errors use OpenAI's JSON shape with the status from `services.common.errors.HTTP_ERRORS` (the
table shared with gRPC codes), an OpenAI-style `code` and `param` naming the field as the caller
sent it. Unknown request fields are ignored and named in the `x-slora-ignored-fields` header.
A client that goes away cancels its worker calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from services.common import errors as e
from services.common.cluster_token import bearer_token, token_matches
from services.gateway.evidence import Served
from services.gateway.fanout import Fanout
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    Plan,
    chat_plan,
    completion_plan,
    parse,
)
from services.gateway.openai_responses import (
    DONE,
    ChoiceState,
    Header,
    Kind,
    Shape,
    StreamEvents,
    error_body,
    full_body,
    served_header,
    served_name,
    sse,
    usage_event,
)
from services.gateway.router import Router
from slora.v1 import inference_pb2 as pb

SERVED_BY_HEADER = "x-slora-served-by"
# `slora serve` (vLLM's single-server mode): the HTTP API acts as this tenant key for every
# caller, who then needs no slora key, or only the one in API_KEY_ENV (vLLM's --api-key).
OPEN_KEY_ENV = "SLORA_HTTP_OPEN_KEY"
API_KEY_ENV = "SLORA_HTTP_API_KEY"
IGNORED_FIELDS_HEADER = "x-slora-ignored-fields"


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    score: float = Field(ge=-1.0, le=1.0)
    labels: dict[str, str] = Field(default_factory=dict)


def error_response(err: e.ServiceError, names: dict[str, str] | None = None) -> JSONResponse:
    status, _kind = e.http_status(err)
    retry = e.retry_after_seconds(err)
    headers = {"retry-after": str(retry)} if retry is not None else None
    return JSONResponse(error_body(err, names), status_code=status, headers=headers)


class HttpApi:
    def __init__(self, router: Router, metrics: GatewayMetrics, base_model: str,
                 env: Mapping[str, str] = os.environ) -> None:
        self.router, self.metrics, self.base_model = router, metrics, base_model
        self.open_key = env.get(OPEN_KEY_ENV, "")
        self.api_key = env.get(API_KEY_ENV, "")

    def app(self) -> FastAPI:
        app = FastAPI(title="slora gateway", docs_url=None, redoc_url=None, openapi_url=None)
        route = self._route
        app.add_api_route("/v1/completions", route("completions", self._completions),
                          methods=["POST"])
        app.add_api_route("/v1/chat/completions", route("chat", self._chat), methods=["POST"])
        app.add_api_route("/v1/models", route("models", self._models), methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", route("model", self._model),
                          methods=["GET"])
        app.add_api_route("/v1/feedback", route("feedback", self._feedback), methods=["POST"])
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/version", _version, methods=["GET"])  # vLLM's, for tools
        app.add_api_route("/metrics", self._prometheus, methods=["GET"])
        app.add_exception_handler(HTTPException, _http_exception)
        return app

    def _route(self, name: str, handler: Callable[[Request], Awaitable[Response]],
               ) -> Callable[[Request], Awaitable[Response]]:
        """`handler` with ServiceErrors (and bugs) answered in OpenAI's shape, counted."""
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except e.ServiceError as err:
                response = error_response(err, getattr(request.state, "names", None))
            except Exception as exc:  # noqa: BLE001 - a bug: answer 500, never a bare trace
                response = error_response(e.as_service_error(exc))
            self.metrics.http_requests.labels(name, str(response.status_code)).inc()
            return response
        return endpoint

    # ---- generation ------------------------------------------------------------------------
    async def _completions(self, request: Request) -> Response:
        token = self._token(request)
        req, ignored = parse(CompletionRequest, await _json(request))
        rid = "cmpl-" + uuid.uuid4().hex
        plan = completion_plan(req, self.base_model, rid)
        return _ignored(await self._generate(request, "completion", req, plan, token, rid),
                        ignored)

    async def _chat(self, request: Request) -> Response:
        token = self._token(request)
        req, ignored = parse(ChatCompletionRequest, await _json(request))
        rid = "chatcmpl-" + uuid.uuid4().hex
        plan = chat_plan(req, self.base_model, rid)
        return _ignored(await self._generate(request, "chat", req, plan, token, rid), ignored)

    def _token(self, request: Request) -> str:
        """The caller's key, checked before the body is read (401 comes before 400)."""
        token = self._caller_key(request)
        self.router.authenticate(token)
        return token

    def _caller_key(self, request: Request) -> str:
        token = bearer_token(request.headers.items())
        if not self.open_key:
            return token
        if self.api_key and not token_matches(token, self.api_key):
            raise e.Unauthenticated("invalid API key")
        return self.open_key

    async def _generate(self, request: Request, kind: Kind,
                        req: CompletionRequest | ChatCompletionRequest, plan: Plan, token: str,
                        rid: str) -> Response:
        request.state.names = plan.names  # errors from here on name the caller's fields
        fanout = Fanout([self.router.call(c, token) for c in plan.calls])
        if not await self._unless_disconnected(request, fanout, fanout.start()):
            return Response(status_code=499)  # nobody reads it; counted as a disconnect
        served = fanout.calls[0].served_by or pb.ServedBy()
        header = Header(kind, rid, req.model, served_name(served, self.base_model))
        headers = {SERVED_BY_HEADER: served_header(served, self.base_model)}
        choices = [ChoiceState(i) for i in range(len(plan.calls))]
        shape = Shape(plan.top_logprobs is not None, plan.echo, plan.prompt_logprobs is not None,
                      plan.n, plan.best_of, drop_generated=plan.drop_generated,
                      tools=plan.tools)
        if req.stream:
            opts = req.stream_options
            usage = bool(opts and opts.include_usage)
            events = StreamEvents(header, shape, usage, bool(opts and opts.continuous_usage_stats),
                                  plan.prompts, plan.names)
            return StreamingResponse(self._stream(fanout, events, choices, plan.n, usage),
                                     media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        try:
            if not await self._unless_disconnected(request, fanout, _read(fanout, choices)):
                return Response(status_code=499)
        finally:
            await fanout.close()
        self._alias(rid, fanout)
        body = full_body(header, choices, shape, plan.prompts)
        return JSONResponse(body, headers=headers)

    async def _unless_disconnected(self, request: Request, fanout: Fanout,
                                   work: Awaitable[None]) -> bool:
        """Run `work`; if the client goes away first, cancel it and every call of `fanout`
        (the workers free the pages) and return False. Starlette watches for a disconnect only
        once a streaming body is being sent; before that (waiting for the first token, or for
        a whole non-streamed answer) this does. `work` runs in this task, not a task of its
        own: a new task waits a loop turn, behind every stream the process is writing (at 64
        streams a gateway process that turn was milliseconds, docs/performance.md); the
        watcher cancels this task instead."""
        task = asyncio.current_task()
        assert task is not None
        gone = done = False

        def on_disconnect(watcher: asyncio.Task[None]) -> None:
            nonlocal gone
            if not done and not watcher.cancelled() and watcher.exception() is None:
                gone = True
                task.cancel()

        watching = asyncio.create_task(_disconnected(request))
        watching.add_done_callback(on_disconnect)
        try:
            await work
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            done = True
            watching.cancel()
        if not gone:
            return True
        task.uncancel()  # the cancel was ours (and `work` took it, or ended first)
        self.metrics.http_disconnects.inc()
        await fanout.close()
        return False

    async def _stream(self, fanout: Fanout, events: StreamEvents, choices: list[ChoiceState],
                      n: int, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the first event is sent as an event (the status
        is already out), and the stream ends without [DONE]. The last choice's finishing event,
        the usage and [DONE] go out as one write (each write is a send on the socket)."""
        tail = b""
        try:
            async for i, r in fanout.events():
                choices[i].add(r)
                event = events.chunk(choices[i], r)
                if r.HasField("complete") and all(c.complete is not None for c in choices):
                    tail = event  # nothing follows but the end of the calls
                    continue
                yield event
            self._alias(events.header.id, fanout)
            if include_usage:
                tail += usage_event(events.header, choices, n)
            yield tail + DONE
        except e.ServiceError as err:
            yield tail + sse(error_body(err, events.names))
        except asyncio.CancelledError:
            self.metrics.http_disconnects.inc()  # the client went away: calls cancelled
            raise
        finally:
            await fanout.close()

    def _alias(self, rid: str, fanout: Fanout) -> None:
        """With several choices (calls `rid-0`, `rid-1`...), feedback may name the response's
        own id: it scores the version that served choice 0 (one routing key for all)."""
        if len(fanout.calls) > 1:
            with contextlib.suppress(e.NotFound):
                s = self.router.served.peek(fanout.calls[0].request_id)
                self.router.served.remember(rid, Served(s.adapter_id, s.version, s.tenant))

    # ---- the rest --------------------------------------------------------------------------
    def _model_list(self, request: Request) -> list[dict[str, Any]]:
        """The base model and the adapters the caller's key may call, with their versions."""
        grant = self.router.authenticate(self._caller_key(request))
        data: list[dict[str, Any]] = [{"id": self.base_model, "object": "model", "created": 0,
                                       "owned_by": "slora", "root": self.base_model,
                                       "parent": None}]
        for a in sorted(self.router.table.adapters.values(), key=lambda a: a.adapter_id):
            if not (grant.admin or a.tenant == grant.tenant):
                continue
            data.append({"id": a.adapter_id, "object": "model", "created": 0,
                         "owned_by": a.tenant, "root": a.adapter_id, "parent": self.base_model,
                         "stable_version": a.stable_version or None,
                         "canary_version": a.canary_version or None,
                         "canary_traffic_ratio": a.traffic_ratio if a.canary_version else 0.0,
                         "fallback_version": a.fallback_version or None})
        return data

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_list(request)})

    async def _model(self, request: Request) -> Response:
        model = request.path_params["model"]
        for entry in self._model_list(request):
            if entry["id"] == model:
                return JSONResponse(entry)
        raise e.NotFound(f"unknown model {model!r} (or not one this key may call)")

    async def _feedback(self, request: Request) -> Response:
        token = self._token(request)
        req = _parse(FeedbackRequest, await _json(request))
        await self.router.report_feedback(pb.ReportFeedbackRequest(
            request_id=req.request_id, score=req.score, labels=req.labels), token)
        return JSONResponse({"object": "feedback", "request_id": req.request_id})

    async def _health(self) -> Response:
        ready = self.router.table.synced and not self.router.draining
        return JSONResponse({"status": "ok" if ready else "unavailable"},
                            status_code=200 if ready else 503)

    async def _prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _ignored(response: Response, ignored: list[str]) -> Response:
    """The response, naming the request's ignored fields in a header (vLLM logs them)."""
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = ",".join(ignored)
    return response


async def _version() -> Response:
    try:
        version = importlib.metadata.version("slora")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without installing
        version = "unknown"
    return JSONResponse({"version": version})


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise e.InvalidArgument(f"the body is not valid JSON: {exc}") from None


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"
                             for err in exc.errors())
        raise e.InvalidArgument(problems) from None


async def _read(fanout: Fanout, choices: list[ChoiceState]) -> None:
    async for i, r in fanout.events():
        choices[i].add(r)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _http_exception(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code,
                                                                       "invalid_request_error")
    return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None,
                                   "code": None}}, status_code=exc.status_code)
