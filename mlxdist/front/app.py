"""The front's routes (FastAPI): the OpenAI API forwarded to the rank
server (streams passed through line by line), ``/health`` and ``/metrics``
of its own, behind the bearer token, refusing bodies that are not JSON.

    app = make_app(settings, job)       # served by uvicorn (front/serve.py)

What a request may hold is the rank server's to check (``serving/schema.py``):
the front reads only what it needs to forward (``stream``), and passes the
body on as the client sent it. While the job does not serve, every new
request is answered 503 with ``Retry-After``; one the job lost before it
answered anything is sent again to the next job (``Upstream``'s hold); a
stream the job drops after its first token ends with a chunk whose
``finish_reason`` is ``"error"`` and an error event.
"""

import asyncio
import contextlib
import hmac
import importlib.util
import json
import time
from typing import Any, AsyncIterator, Dict, Optional, Tuple

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.middleware.cors import CORSMiddleware

from mlxdist.errors import RequestError
from mlxdist.front.errors import DEFAULT_RETRY_AFTER, Unavailable, refusal, unavailable_body
from mlxdist.front.limits import Guard
from mlxdist.front.metrics import CONTENT_TYPE, SERVING_STATES, FrontMetrics
from mlxdist.front.observe import Queued
from mlxdist.front.upstream import DEFAULT_HOLD, DEFAULT_MAX_HELD, Upstream
from mlxdist.inputs import json_input
from mlxdist.inputs.digits import parse_int

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/chat/completions")
JSON_TYPES = ("application/json",)
_USAGE_ASKED = b', "stream_options": {"include_usage": true}}'
_HEALTH_TIMEOUT = 1.0


class CompletionRequest(BaseModel):
    """What the front reads of a completion request: whether it streams,
    and whether it asked for usage; every other field goes on unread."""

    model_config = ConfigDict(extra="allow")
    stream: Optional[StrictBool] = None


def make_app(settings: Any, job: Any, upstream: Optional[Upstream] = None) -> Any:
    """The front's ASGI application over ``job`` (``base_url``, ``state``,
    ``ranks``, ``hosts``, ``last_recovery``): FastAPI inside, from the
    outside in, the ``Guard`` (Host, connection cap), CORS
    (``settings.allow_origins``) and ``KeyAndCount`` (the bearer token)."""
    upstream = upstream or Upstream(job, retry_after=settings.retry_after,
                                    hold=getattr(settings, "recovery_hold", DEFAULT_HOLD),
                                    max_held=getattr(settings, "recovery_hold_max", DEFAULT_MAX_HELD))
    metrics = FrontMetrics(job, upstream)
    app = FastAPI(title="mlxdist", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.upstream, app.state.metrics, app.state.job = upstream, metrics, job
    _errors_as_openai(app, settings)

    async def forward(request: Request) -> Response:
        raw, streaming, usage_added = await _read_request(request, settings.max_body)
        started = time.monotonic()
        if not streaming:
            queued = Queued(metrics)
            try:
                with _live(job):
                    answer = await upstream.post(request.url.path, raw, request.headers)
            finally:
                queued.done()
            metrics.latency.observe(time.monotonic() - started)
            if answer.status_code == 200:
                try:
                    metrics.count_usage(json.loads(answer.content).get("usage"))
                except (ValueError, AttributeError):
                    pass
            return _passed_on(answer, retry_after=settings.retry_after)
        return await _stream(request.url.path, raw, request.headers, usage_added, upstream, metrics, started, job)

    for path in COMPLETION_PATHS:
        app.add_api_route(path, forward, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models", include_in_schema=False)
    async def models():
        return _passed_on(await upstream.get("/v1/models"), retry_after=settings.retry_after)

    @app.get("/health", include_in_schema=False)
    async def health():
        state = getattr(job, "state", "stopped")
        body = {"status": state, "ranks": getattr(job, "ranks", None), "hosts": getattr(job, "hosts", None),
                "last_recovery": getattr(job, "last_recovery", None), "port": settings.port}
        if state in SERVING_STATES:
            return JSONResponse(body)
        return JSONResponse(body, 503, headers={"Retry-After": str(settings.retry_after)})

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        metrics.rank_health = await _rank_health(upstream)
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    _agent_routers(app, upstream, settings)
    app.add_middleware(KeyAndCount, key=settings.api_key, metrics=metrics)
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allow_origins), allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(Guard, settings=settings)
    return app


class KeyAndCount:
    """ASGI: the bearer token checked (401 otherwise; CORS preflights are
    answered outside), and every answer counted by path and status."""

    def __init__(self, app: Any, key: Optional[str], metrics: FrontMetrics):
        self.app, self.key, self.metrics = app, key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = _path_label(scope["path"])

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        if self.key is not None and not _key_ok(scope, self.key):
            if scope["path"].startswith("/v1/messages"):  # Anthropic's clients read Anthropic's error shape
                from mlxdist.front.messages import error_response

                await error_response("missing or wrong API key", 401)(scope, receive, counted)
                return
            await _refuse(401, "missing or wrong API key")(scope, receive, counted)
            return
        await self.app(scope, receive, counted)


async def _read_request(request: Request, max_body: int) -> Tuple[bytes, bool, bool]:
    """The body of a completion request as sent, whether it streams, and
    whether the front asked the rank server for usage the client did not
    (then added to the bytes, and its chunk kept from the client)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in JSON_TYPES:
        raise RequestError(f"the request body must be JSON, sent with Content-Type: application/json, "
                           f"not {kind[:60]!r}" if kind else "Content-Type: application/json is required",
                           "Content-Type", 415)
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = parse_int(length.strip(" \t"), "Content-Length")
        except ValueError as e:
            raise RequestError(str(e), "Content-Length") from None
        if declared > max_body:
            raise RequestError(f"request body of {declared} bytes exceeds the limit of {max_body}", None, 413)
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body:
                raise RequestError(f"request body exceeds the limit of {max_body} bytes", None, 413)
    except ClientDisconnect:  # gone, or cut at --request-timeout (limits.py): no one to answer
        raise RequestError("the client left before its request arrived whole", None, 408) from None
    raw = bytes(raw)
    try:
        body = json_input.parse(raw, max_body)
    except ValueError as e:
        raise RequestError(f"the request body {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        streaming = bool(CompletionRequest.model_validate(body).stream)
    except ValidationError:
        raise RequestError("stream must be true or false", "stream") from None
    if streaming and "stream_options" not in body:
        return raw.rstrip()[:-1] + _USAGE_ASKED, True, True
    return raw, streaming, False


async def _stream(path: str, raw: bytes, headers, usage_added: bool, upstream: Upstream, metrics: FrontMetrics,
                  started: float, job: Any) -> Response:
    """The rank server's stream, passed on line by line once it answers 200
    (any other status: its answer whole)."""
    queued = Queued(metrics)  # until the first chunk with choices
    live = _live(job)
    live.__enter__()
    context = upstream.stream(path, raw, headers)
    try:
        answer = await context.__aenter__()
        if answer.status_code != 200:
            body = await answer.aread()
            await context.__aexit__(None, None, None)
            live.__exit__(None, None, None)
            queued.done()
            return _passed_on(answer, body, upstream.retry_after)
    except BaseException:
        live.__exit__(None, None, None)
        queued.done()
        raise

    async def lines() -> AsyncIterator[bytes]:
        metrics.running.inc()
        last: Dict[str, Any] = {}
        skip_blank = False
        chunk_at = started
        try:
            try:
                async for line in answer.aiter_lines():
                    if skip_blank and not line:
                        skip_blank = False
                        continue
                    chunk = _chunk(line)
                    if chunk is not None:
                        if chunk.get("error") is not None:  # the rank server's own: the job failed mid-answer
                            yield _finish_chunk(last, path)
                            yield (line + "\n\n").encode()
                            return
                        if chunk.get("choices"):
                            last, now = chunk, time.monotonic()
                            if queued.counted:
                                queued.done()
                                metrics.first_token.observe(now - started)
                            else:
                                metrics.per_token.observe(now - chunk_at)
                            chunk_at = now
                        if "usage" in chunk:
                            metrics.count_usage(chunk["usage"])
                            if usage_added and not chunk.get("choices"):
                                skip_blank = True
                                continue
                    yield (line + "\n").encode()
            except Unavailable as e:
                yield _finish_chunk(last, path)
                yield f"data: {json.dumps(unavailable_body(e))}\n\n".encode()
        finally:
            queued.done()
            metrics.running.dec()
            metrics.latency.observe(time.monotonic() - started)
            live.__exit__(None, None, None)
            with anyio.CancelScope(shield=True):  # a client gone: the rank server's connection closed all the same
                await context.__aexit__(None, None, None)

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _rank_health(upstream: Upstream) -> Optional[Dict[str, Any]]:
    """The rank server's /health (None while the job does not serve, or
    where it does not answer within a second), for ``FrontMetrics.rank_health``."""
    try:
        answer = await asyncio.wait_for(upstream.get("/health"), _HEALTH_TIMEOUT)
        body = json.loads(answer.content)
    except (Unavailable, asyncio.TimeoutError, ValueError, AttributeError):
        return None
    return body if isinstance(body, dict) else None


def _live(job: Any):
    """``job.request()`` where the job has it (growing back waits for no live request)."""
    request = getattr(job, "request", None)
    return request() if request is not None else contextlib.nullcontext()


def _chunk(line: str) -> Optional[Dict[str, Any]]:
    if not line.startswith("data: {"):
        return None
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _finish_chunk(last: Dict[str, Any], path: str) -> bytes:
    """A last chunk whose ``finish_reason`` is ``"error"``, shaped as the stream's own."""
    chat = "chat" in path
    choice = {"index": 0, "finish_reason": "error", **({"delta": {}} if chat else {"text": ""})}
    chunk = {"id": last.get("id", ""), "object": last.get("object", "chat.completion.chunk" if chat else
                                                          "text_completion"),
             "created": last.get("created", int(time.time())), "model": last.get("model", ""), "choices": [choice]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _passed_on(answer, body: Optional[bytes] = None, retry_after: int = DEFAULT_RETRY_AFTER) -> Response:
    """The rank server's answer as the front's: status, body and type (and
    ``Retry-After`` on a 503)."""
    headers = {"Retry-After": answer.headers["retry-after"]} if "retry-after" in answer.headers else {}
    if answer.status_code == 503 and not headers:
        headers = {"Retry-After": str(retry_after)}
    return Response(answer.content if body is None else body, answer.status_code, headers=headers,
                    media_type=answer.headers.get("content-type", "application/json"))


def _key_ok(scope, key: str) -> bool:
    """The token as ``Authorization: Bearer`` (OpenAI's clients) or ``x-api-key`` (Anthropic's)."""
    headers = dict(scope.get("headers", ()))
    return (hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode())
            or hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode()))


def _refuse(status: int, message: str, param: Optional[str] = None, headers: Optional[Dict[str, str]] = None
            ) -> JSONResponse:
    return JSONResponse(refusal(message, status, param), status, headers=headers)


def _path_label(path: str) -> str:
    """A metric label bounded to the paths the front serves (a client's made-up ones are 'other')."""
    known = (*COMPLETION_PATHS, "/v1/models", "/health", "/metrics", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses")
    return path if path in known else "other"


def _errors_as_openai(app: FastAPI, settings: Any) -> None:
    """Every error the front answers in OpenAI's shape."""

    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        return _refuse(e.status, str(e), e.param)

    @app.exception_handler(Unavailable)
    async def unavailable(request, e: Unavailable):
        return JSONResponse(unavailable_body(e), 503, headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = {404: f"no such path {request.url.path[:100]!r}",
                   405: f"method {request.method} is not allowed here"}.get(e.status_code, str(e.detail))
        return _refuse(e.status_code, message, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _refuse(400, first.get("msg", "invalid request"), param)


def _agent_routers(app: FastAPI, upstream: Upstream, settings: Any) -> None:
    """The Anthropic Messages and OpenAI Responses routes, where their modules
    exist, with the front's body limit; responses kept for
    ``previous_response_id``: ``settings.responses_store`` of them."""
    if importlib.util.find_spec("mlxdist.front.messages") is not None:
        from mlxdist.front import messages

        app.include_router(messages.router(upstream, settings.max_body))
    if importlib.util.find_spec("mlxdist.front.responses") is not None:
        from mlxdist.front import responses, store

        kept = store.ResponseStore(getattr(settings, "responses_store", store.DEFAULT_RESPONSES))
        app.include_router(responses.router(upstream, kept, settings.max_body))
