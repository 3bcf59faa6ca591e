"""Anthropic's Messages API on the front: ``POST /v1/messages`` (plain or
streamed) and ``POST /v1/messages/count_tokens``, each asked of the rank
server's ``/v1/chat/completions`` and ``/tokenize`` (``translate.py``), and
every refusal in Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``.

A streamed answer is Anthropic's event sequence: ``message_start``, a
``ping``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, ``input_json_delta``, ``thinking_delta``) /
``content_block_stop``, then ``message_delta`` (stop reason and usage) and
``message_stop``; a ``ping`` for each keepalive of a long prefill; an
``error`` event when the rank job fails mid-answer.
"""

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mlxdist.front.errors import Unavailable
from mlxdist.front.messages_schema import CountTokensRequest, MessagesRequest, first_error
from mlxdist.front.observe import Queued, observed
from mlxdist.front.translate import (
    CHAT_PATH, TOKENIZE_PATH, AnswerFailed, Event, Finish, Keepalive, Reasoning, Text, ToolCall, UpstreamError,
    Usage, anthropic_to_chat, arguments_object, chat_events, close, live_request, read_request,
    upstream_refusal,
)
from mlxdist.serving.connections import DEFAULT_MAX_BODY

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(message: str, status: int) -> Dict[str, Any]:
    """Anthropic's error object for HTTP ``status``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(message: str, status: int, retry_after: Optional[int] = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def _sse(kind: str, data: Dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicAnswer:
    """The rank server's answer (``translate`` events) as Anthropic's: the
    stream's events as they come (``start``, ``add``, ``end``) and the
    whole ``message()``. ``silent``: read the prompt, show nothing
    (``max_tokens`` 0); ``thinking``: the model's reasoning is shown as
    thinking blocks (else dropped, as Anthropic's models without thinking)."""

    def __init__(self, model: str, silent: bool = False, thinking: bool = False):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.silent = silent
        self.thinking = thinking
        self.blocks: List[Dict[str, Any]] = []
        self.open: Optional[str] = None  # the type of the block being streamed
        self.finish: Optional[Finish] = None
        self.usage: Optional[Usage] = None
        self.text = ""  # every character shown, for counting when the rank server gave no usage

    def start(self) -> List[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [_sse("message_start", {"type": "message_start", "message": message}), _sse("ping", {"type": "ping"})]

    def add(self, event: Event) -> List[str]:
        """Events to send for ``event``; raises ``AnswerFailed`` for the rank server's error."""
        if isinstance(event, UpstreamError):
            raise AnswerFailed(event.message, event.status)
        if isinstance(event, Keepalive):
            return [_sse("ping", {"type": "ping"})]
        if isinstance(event, Finish):
            self.finish = event
            return []
        if isinstance(event, Usage):
            self.usage = event
            return []
        if self.silent:
            return []
        if isinstance(event, Text):
            self.text += event.text
            return self._delta("text", {"type": "text_delta", "text": event.text}, "text", event.text)
        if isinstance(event, Reasoning):
            if not self.thinking:
                return []
            return self._delta("thinking", {"type": "thinking_delta", "thinking": event.text}, "thinking", event.text)
        if isinstance(event, ToolCall):
            return self._tool_use(event)
        return []

    def end(self) -> List[str]:
        out = self._close()
        delta = {"stop_reason": self.stop_reason(), "stop_sequence": self.finish.stop_sequence if self.finish else None}
        out.append(_sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage_object()}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out

    def message(self) -> Dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
                "stop_reason": self.stop_reason(),
                "stop_sequence": self.finish.stop_sequence if self.finish else None, "usage": self.usage_object()}

    def stop_reason(self) -> str:
        if self.silent:
            return "max_tokens"
        if any(b["type"] == "tool_use" for b in self.blocks) and (self.finish is None or self.finish.reason == "stop"):
            return "tool_use"
        return STOP_REASONS.get(self.finish.reason if self.finish else "stop", "end_turn")

    def usage_object(self) -> Dict[str, Any]:
        usage = self.usage or Usage(0, 0)
        cached = usage.cached_tokens
        out = {"input_tokens": usage.prompt_tokens - (cached or 0),
               "output_tokens": 0 if self.silent else usage.completion_tokens}
        if cached is not None:
            out["cache_read_input_tokens"] = cached
        return out

    def _delta(self, kind: str, delta: Dict[str, Any], field: str, piece: str) -> List[str]:
        out = []
        if self.open != kind:
            out += self._close()
            block = {"type": kind, field: ""}
            self.blocks.append(block if kind == "text" else {**block, "signature": ""})
            self.open = kind
            out.append(_sse("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": dict(self.blocks[-1])}))
        self.blocks[-1][field] += piece
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                "delta": delta}))
        return out

    def _tool_use(self, call: ToolCall) -> List[str]:
        out = self._close()
        tool_id = call.id or f"toolu_{uuid.uuid4().hex[:24]}"
        arguments = arguments_object(call.arguments)
        self.blocks.append({"type": "tool_use", "id": tool_id, "name": call.name, "input": arguments})
        index = len(self.blocks) - 1
        out.append(_sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
            "type": "tool_use", "id": tool_id, "name": call.name, "input": {}}}))
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}}))
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    def _close(self) -> List[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                    "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
        return out


async def _read(request: Request, model: type, max_body: int) -> Any:
    """The request body as ``model``, or ``AnswerFailed`` (4xx) with one line."""
    body = await read_request(request, max_body)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise AnswerFailed(first_error(e), 400) from None
    refused = parsed.refused_field()
    if refused is not None:
        raise AnswerFailed(refused, 400)
    return parsed


async def count_prompt(upstream: Any, body: Dict[str, Any]) -> int:
    """Tokens of a chat body's prompt (messages, tools) or text (``prompt``), counted by the rank server."""
    response = await upstream.post(TOKENIZE_PATH, body)
    if response.status_code != 200:
        raise await upstream_refusal(response)
    return int(response.json()["count"])


def router(upstream: Any, max_body: int = DEFAULT_MAX_BODY) -> APIRouter:
    """The routes of Anthropic's Messages API over ``upstream``
    (``front.upstream.Upstream``), taking bodies of at most ``max_body`` bytes."""
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        started = time.monotonic()
        stack = contextlib.AsyncExitStack()
        try:
            parsed = await _read(request, MessagesRequest, max_body)
            try:
                chat = anthropic_to_chat(parsed)
            except ValueError as e:
                raise AnswerFailed(str(e), 400) from None
            answer = AnthropicAnswer(parsed.model, silent=parsed.max_tokens == 0,
                                     thinking=parsed.thinking is not None and parsed.thinking.type != "disabled")
            stack.enter_context(live_request(upstream))
            metrics = getattr(request.app.state, "metrics", None)
            queued = Queued(metrics)
            stack.callback(queued.done)
            response = await stack.enter_async_context(upstream.stream(CHAT_PATH, chat, request.headers))
            if response.status_code != 200:
                raise await upstream_refusal(response)
            events = observed(chat_events(response.aiter_lines(), parsed.stop_sequences or ()), metrics, started,
                              queued)
            stack.push_async_callback(events.aclose)  # first: the metrics' finally, then the stream
            if not parsed.stream:
                async for event in events:
                    answer.add(event)
                await stack.aclose()
                await _complete_usage(upstream, answer, chat)
                return JSONResponse(answer.message())
        except AnswerFailed as e:
            await stack.aclose()
            return error_response(str(e), e.status, e.retry_after)
        except Unavailable as e:
            await stack.aclose()
            return error_response(str(e), 503, e.retry_after)
        except BaseException:
            await stack.aclose()
            raise
        return StreamingResponse(_stream(answer, events, stack, upstream, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            parsed = await _read(request, CountTokensRequest, max_body)
            probe = MessagesRequest.model_validate({**parsed.model_dump(exclude_none=True), "max_tokens": 1})
            chat = anthropic_to_chat(probe, answering=False)
            return JSONResponse({"input_tokens": await count_prompt(upstream, {
                k: chat[k] for k in ("messages", "tools") if k in chat})})
        except AnswerFailed as e:
            return error_response(str(e), e.status, e.retry_after)
        except ValueError as e:
            return error_response(str(e), 400)
        except Unavailable as e:
            return error_response(str(e), 503, e.retry_after)

    return routes


async def _complete_usage(upstream: Any, answer: AnthropicAnswer, chat: Dict[str, Any]) -> None:
    """Usage where the stream was closed at a stop sequence, before the rank
    server's count: the prompt and the text shown up to and with the stop
    sequence, counted by its tokenizer."""
    if answer.usage is not None or answer.finish is None or answer.finish.stop_sequence is None:
        return
    prompt = await count_prompt(upstream, {k: chat[k] for k in ("messages", "tools") if k in chat})
    output = await count_prompt(upstream, {"prompt": answer.text + answer.finish.stop_sequence})
    answer.usage = Usage(prompt, output)


async def _stream(answer: AnthropicAnswer, events: AsyncIterator[Event], stack: contextlib.AsyncExitStack,
                  upstream: Any, chat: Dict[str, Any]) -> AsyncIterator[str]:
    try:
        for out in answer.start():
            yield out
        async for event in events:
            for out in answer.add(event):
                yield out
        await stack.aclose()
        await _complete_usage(upstream, answer, chat)
        for out in answer.end():
            yield out
    except AnswerFailed as e:
        yield _sse("error", error_body(str(e), e.status))
    except Unavailable as e:
        yield _sse("error", error_body(str(e), 503))
    finally:
        await close(stack)
