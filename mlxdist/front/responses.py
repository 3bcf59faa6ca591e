"""OpenAI's Responses API on the front: ``POST /v1/responses`` (plain or
streamed), asked of the rank server's ``/v1/chat/completions``
(``translate.py``), with ``previous_response_id`` read from the front's
bounded store (``store.py``; ``store: false`` keeps nothing) and every
refusal in OpenAI's error shape.

A streamed answer is the Responses event sequence, each event numbered
(``sequence_number``): ``response.created``, ``response.in_progress``; per
output item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, for a
function call ``response.function_call_arguments.delta`` / ``.done``, for
the model's reasoning ``response.reasoning_text.delta`` / ``.done``;
``response.output_item.done``; then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``, ``response.failed`` when
the rank job fails mid-answer).
"""

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mlxdist.front.errors import Unavailable, refusal
from mlxdist.front.messages_schema import first_error
from mlxdist.front.responses_schema import ResponsesRequest
from mlxdist.front.store import ResponseStore
from mlxdist.front.observe import Queued, observed
from mlxdist.front.translate import (
    CHAT_PATH, AnswerFailed, Event, Finish, Keepalive, Reasoning, Text, ToolCall, UpstreamError, Usage, chat_events,
    close, live_request, read_request, responses_to_chat, upstream_refusal,
)
from mlxdist.serving.connections import DEFAULT_MAX_BODY


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesAnswer:
    """The rank server's answer (``translate`` events) as a Responses
    object: the stream's events as they come (``start``, ``add``, ``end``)
    and the whole ``response()``; ``messages()`` is the answer as chat
    messages, for the store."""

    def __init__(self, request: ResponsesRequest):
        self.request = request
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: List[Dict[str, Any]] = []
        self.open_message: Optional[Dict[str, Any]] = None
        self.open_reasoning: Optional[Dict[str, Any]] = None
        self.finish: Optional[Finish] = None
        self.usage: Optional[Usage] = None
        self.sequence = 0
        self.failure: Optional[str] = None

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> List[str]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def add(self, event: Event) -> List[str]:
        """Events to send for ``event``; raises ``AnswerFailed`` for the rank server's error."""
        if isinstance(event, UpstreamError):
            raise AnswerFailed(event.message, event.status)
        if isinstance(event, Keepalive):
            return [": keepalive\n\n"]
        if isinstance(event, Finish):
            self.finish = event
        elif isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Text):
            return self._text(event.text)
        elif isinstance(event, Reasoning):
            return self._reasoning(event.text)
        elif isinstance(event, ToolCall):
            return self._call(event)
        return []

    def end(self) -> List[str]:
        out = self._close_reasoning() + self._close_message()
        status = self.status()
        out.append(self._event(f"response.{status}", response=self.response(status)))
        return out

    def fail(self, message: str) -> List[str]:
        """The stream's last event when the rank job failed mid-answer."""
        self.failure = message
        return [self._event("response.failed", response=self.response("failed"))]

    def status(self) -> str:
        return "incomplete" if self.finish is not None and self.finish.reason == "length" else "completed"

    def response(self, status: Optional[str] = None) -> Dict[str, Any]:
        status = status or self.status()
        request = self.request
        usage = None
        if self.usage is not None:
            usage = {"input_tokens": self.usage.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": self.usage.cached_tokens or 0},
                     "output_tokens": self.usage.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.usage.prompt_tokens + self.usage.completion_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": {"code": "server_error", "message": self.failure} if self.failure else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": request.model, "output": self.output if status != "in_progress" else [],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "store": request.store is not False,
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": request.metadata or {},
            "usage": usage,
        }

    def messages(self) -> List[Dict[str, Any]]:
        """The answer as one assistant chat message (its text, its tool calls)."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.output if item["type"] == "function_call"]
        message: Dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]

    def _reasoning(self, text: str) -> List[str]:
        """The model's reasoning (mlx-lm's, between its think tags) as a reasoning item's text."""
        out = self._close_message()
        if self.open_reasoning is None:
            self.open_reasoning = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                                   "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self.open_reasoning)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(self.open_reasoning, content=[])))
        self.open_reasoning["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", item_id=self.open_reasoning["id"],
                               output_index=len(self.output) - 1, content_index=0, delta=text))
        return out

    def _close_reasoning(self) -> List[str]:
        item = self.open_reasoning
        if item is None:
            return []
        self.open_reasoning = None
        index = self.output.index(item)
        item["status"] = "completed"
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, text: str) -> List[str]:
        out = self._close_reasoning()
        if self.open_message is None:
            self.open_message = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                                 "role": "assistant", "content": []}
            self.output.append(self.open_message)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(self.open_message, content=[])))
            self.open_message["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self._event("response.content_part.added", item_id=self.open_message["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.open_message["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.open_message["id"],
                               output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> List[str]:
        message = self.open_message
        if message is None:
            return []
        self.open_message = None
        index = self.output.index(message)
        part = message["content"][0]
        message["status"] = "incomplete" if self.status() == "incomplete" else "completed"
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=message)]

    def _call(self, call: ToolCall) -> List[str]:
        out = self._close_reasoning() + self._close_message()
        item = {"id": _new_id("fc"), "type": "function_call", "status": "completed",
                "call_id": call.id or _new_id("call"), "name": call.name, "arguments": call.arguments}
        self.output.append(item)
        index = len(self.output) - 1
        out.append(self._event("response.output_item.added", output_index=index,
                               item=dict(item, arguments="", status="in_progress")))
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=call.arguments))
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=call.name, arguments=call.arguments))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out


def error_response(message: str, status: int, param: Optional[str] = None,
                   retry_after: Optional[int] = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(refusal(message, status, param), status_code=status, headers=headers)


def router(upstream: Any, store: ResponseStore, max_body: int = DEFAULT_MAX_BODY) -> APIRouter:
    """The route of OpenAI's Responses API over ``upstream``
    (``front.upstream.Upstream``), keeping responses in ``store``, taking
    bodies of at most ``max_body`` bytes."""
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        started = time.monotonic()
        stack = contextlib.AsyncExitStack()
        try:
            try:
                parsed = ResponsesRequest.model_validate(await read_request(request, max_body))
            except ValidationError as e:
                raise AnswerFailed(first_error(e), 400) from None
            refused = parsed.refused_field()
            if refused is not None:
                raise AnswerFailed(refused, 400)
            history: List[Dict[str, Any]] = []
            if parsed.previous_response_id is not None:
                history = store.get(parsed.previous_response_id)
                if history is None:
                    return error_response(f"previous response {parsed.previous_response_id[:80]!r} is not kept here "
                                          f"(never stored, made with store: false, or dropped: the front keeps "
                                          f"the last {store.capacity})", 400, "previous_response_id")
            conversation, chat = responses_to_chat(parsed, history)
            answer = ResponsesAnswer(parsed)
            stack.enter_context(live_request(upstream))
            metrics = getattr(request.app.state, "metrics", None)
            queued = Queued(metrics)
            stack.callback(queued.done)
            response = await stack.enter_async_context(upstream.stream(CHAT_PATH, chat, request.headers))
            if response.status_code != 200:
                raise await upstream_refusal(response)
            events = observed(chat_events(response.aiter_lines()), metrics, started, queued)
            stack.push_async_callback(events.aclose)  # first: the metrics' finally, then the stream
            if not parsed.stream:
                async for event in events:
                    answer.add(event)
                await stack.aclose()
                answer.end()  # closes the open message
                _keep(store, parsed, answer, conversation)
                return JSONResponse(answer.response())
        except AnswerFailed as e:
            await stack.aclose()
            return error_response(str(e), e.status, retry_after=e.retry_after)
        except ValueError as e:
            await stack.aclose()
            return error_response(str(e), 400)
        except Unavailable as e:
            await stack.aclose()
            return error_response(str(e), 503, retry_after=e.retry_after)
        except BaseException:
            await stack.aclose()
            raise
        return StreamingResponse(_stream(answer, events, stack, store, parsed, conversation),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return routes


def _keep(store: ResponseStore, request: ResponsesRequest, answer: ResponsesAnswer,
          conversation: List[Dict[str, Any]]) -> None:
    if request.store is not False:
        store.put(answer.id, conversation + answer.messages())


async def _stream(answer: ResponsesAnswer, events: AsyncIterator[Event], stack: contextlib.AsyncExitStack,
                  store: ResponseStore, request: ResponsesRequest, conversation: List[Dict[str, Any]]
                  ) -> AsyncIterator[str]:
    try:
        for out in answer.start():
            yield out
        async for event in events:
            for out in answer.add(event):
                yield out
        await stack.aclose()
        _keep(store, request, answer, conversation)
        for out in answer.end():
            yield out
    except (AnswerFailed, Unavailable) as e:
        for out in answer.fail(str(e)):
            yield out
    finally:
        await close(stack)
