"""The agent APIs in terms of the rank server's ``/v1/chat/completions``:
their requests turned into one chat completion body, and its streamed
answer read back as a few kinds of events that each API writes in its own
shape (``messages.py``, ``responses.py``).

    anthropic_to_chat(MessagesRequest) -> chat body            (a ValueError: a 400, one line)
    responses_to_chat(ResponsesRequest, history) -> (chat messages of the conversation, chat body)
    async for event in chat_events(lines, stop_sequences): ...  # Text, Reasoning, ToolCall, Finish, Usage,
                                                                  # Keepalive, UpstreamError

Every answer is asked of the rank server as a stream (with its usage), plain
answers too: one path, and stop sequences are matched here, on the text, so
a stop sequence the model spells in other tokens still stops it (the rank
server matches stop words as token sequences), and which one matched is
known. The stream is closed at the match, which ends the sequence on every
rank.
"""

import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import anyio
from pydantic import ValidationError

from mlxdist.errors import AnswerFailed
from mlxdist.inputs import json_input
from mlxdist.serving.schema import read_object
from mlxdist.front.messages_schema import (
    MessagesRequest, RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock, Tool,
    parse_blocks, first_error,
)

MAX_PROMPT_CHARS = 1 << 20  # as the rank server's RequestLimits.max_prompt_chars


# --- requests ---------------------------------------------------------------------------------------------------

CHAT_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"  # the rank server's token count (serving/tokenize.py)


async def upstream_refusal(response: Any) -> AnswerFailed:
    """The rank server's refusal (an OpenAI-shaped body, read here) as ``AnswerFailed``."""
    raw = await response.aread()
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace")[:200] or f"the rank server answered {response.status_code}"
    retry = response.headers.get("retry-after")
    return AnswerFailed(str(message), response.status_code, int(retry) if retry and retry.isdigit() else None)


async def read_request(request: Any, max_body: int) -> Dict[str, Any]:
    """A request's JSON body (``read_body``), read up to ``max_body`` bytes:
    a larger one (by its Content-Length, else as it arrives) is a 413, a
    body sent as anything but JSON a 415, as the front's OpenAI routes
    answer them."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise AnswerFailed(f"the request body must be JSON, sent with Content-Type: application/json, not "
                           f"{kind[:60]!r}" if kind else "Content-Type: application/json is required", 415)
    length = request.headers.get("content-length", "").strip(" \t")
    if length.isascii() and length.isdigit() and len(length) < 20 and int(length) > max_body:
        raise AnswerFailed(f"request body of {int(length)} bytes exceeds the limit of {max_body}", 413)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body:
            raise AnswerFailed(f"request body exceeds the limit of {max_body} bytes", 413)
    try:
        return read_body(bytes(raw))
    except ValueError as e:
        raise AnswerFailed(str(e), 400) from None


def read_body(raw: bytes) -> Dict[str, Any]:
    """A request body as the rank server reads one (``json_input``): strict
    UTF-8, nesting at most ``MAX_DEPTH``, numbers Python can hold, no lone
    surrogates; a ValueError (a 400) with the reason. Its size is the
    front's to bound, before it is read."""
    body = read_object(raw, json_input.MAX_DEPTH)  # a RequestError is a ValueError
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the request body holds a lone surrogate (U+D800 to U+DFFF), which is not text") from None
    return body


def anthropic_to_chat(request: MessagesRequest, answering: bool = True) -> Dict[str, Any]:
    """The chat completion body asking what ``request`` asks (streamed, with
    usage; no ``stop``: ``chat_events`` matches the stop sequences);
    ``answering`` False: only its prompt is wanted (a count), which may end
    with the assistant's message."""
    messages: List[Dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text_of(request.system)})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        messages.extend(_anthropic_message(message.role, parse_blocks(message.content, where), where))
    if answering and request.messages[-1].role == "assistant":  # mlx-lm's server has no continue_final_message
        raise ValueError(f"messages[{len(request.messages) - 1}]: the last message is the assistant's (a prefill "
                         f"to continue), which this server does not continue: end with the user's turn")
    _check_chars(messages)
    body: Dict[str, Any] = {"model": request.model, "messages": messages,
                            "max_tokens": max(1, request.max_tokens),
                            "stream": True, "stream_options": {"include_usage": True}}
    tools = anthropic_tools(request.tools)
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise ValueError("tool_choice: a choice of type 'tool' names the tool (name)")
    if tools and not (choice is not None and choice.type == "none"):  # "none": the model is not shown them
        body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    return body


def anthropic_tools(tools: Optional[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Anthropic's tools as chat tools (``{"type": "function", ...}``); a
    tool Anthropic's own servers run (web search, code execution) is a
    ValueError: nothing here runs it."""
    out = []
    for i, raw in enumerate(tools or ()):
        if raw.get("type") not in (None, "custom"):
            raise ValueError(f"tools[{i}]: a tool of type {str(raw.get('type'))[:60]!r} is run by Anthropic's "
                             f"servers; this server takes tools the client runs (no type, or 'custom')")
        try:
            tool = Tool.model_validate(raw)
        except ValidationError as e:
            raise ValueError(first_error(e, f"tools[{i}]")) from None
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _anthropic_message(role: str, blocks: list, where: str) -> List[Dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become
    tool messages (first, as chat templates want them right after the
    calls), an assistant's tool_use blocks its tool_calls; thinking handed
    back is not shown to the model again."""
    if role == "system":
        return [{"role": "system", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}]
    out: List[Dict[str, Any]] = []
    text, calls = [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise ValueError(f"{where}: a tool_result block belongs in a user message")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text_of(block.content or "")})
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise ValueError(f"{where}: a tool_use block belongs in an assistant message")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise ValueError(f"{where}: a {block.type} block is not read here")
    if text or calls or not out:
        message: Dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _text_of(content: Union[str, List[TextBlock]]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _check_chars(messages: List[Dict[str, Any]]) -> None:
    chars = 0
    for message in messages:
        chars += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            chars += len(call["function"]["arguments"])
    if chars > MAX_PROMPT_CHARS:
        raise ValueError(f"the conversation's {chars} characters exceed the limit of {MAX_PROMPT_CHARS}")


def responses_to_chat(request: Any, history: Sequence[Dict[str, Any]] = ()) -> Tuple[List[Dict[str, Any]],
                                                                                   Dict[str, Any]]:
    """(the conversation so far: ``history``, the earlier response's, and
    this request's input, as chat messages; the chat completion body asking
    for its next turn, ``instructions`` first). ``request`` is a
    ``ResponsesRequest``; its instructions are its own, not the
    conversation's (as OpenAI's ``previous_response_id`` keeps them)."""
    from mlxdist.front.responses_schema import FunctionCallItem, FunctionCallOutputItem, MessageItem, part_text

    conversation = list(history)
    for i, item in enumerate(request.items()):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role  # chat templates know "system"
            conversation.append({"role": role, "content": part_text(item.content, f"input[{i}]")})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            _check_arguments(item.arguments, f"input[{i}].arguments")
            last = conversation[-1] if conversation else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn: one assistant message
                conversation[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            else:
                conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            conversation.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": part_text(item.output, f"input[{i}].output")})
    if not any(m["role"] != "system" for m in conversation):
        raise ValueError("input: the conversation needs at least one message")
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    _check_chars(messages)
    body: Dict[str, Any] = {"model": request.model or "default_model", "messages": messages,
                            "stream": True, "stream_options": {"include_usage": True}}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    tools = [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                 ("parameters", t.parameters)) if v is not None}}
             for t in request.function_tools()]
    if tools and request.tool_choice != "none":
        body["tools"] = tools
        choice = request.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif isinstance(choice, str):
            body["tool_choice"] = choice
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    for name in ("temperature", "top_p"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    return conversation, body


def _check_arguments(arguments: str, where: str) -> None:
    """A call's arguments are JSON text, read as every body is (bounded nesting, numbers Python holds)."""
    try:
        raw = arguments.encode("utf-8")
        value = json_input.parse(raw, len(raw), json_input.MAX_DEPTH)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{where} must be JSON text ({e})") from None
    if json_input.first_unreadable(value) is not None:
        raise ValueError(f"{where} holds {json_input.first_unreadable(value)}, which is no number mlxdist reads")


# --- the rank server's answer -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call, as mlx-lm's tool parser gave it: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Finish:
    """Why the answer ended: "stop" (the end of its turn), "length",
    "tool_calls" or "stop_sequence" (then ``stop_sequence`` is the one met)."""

    reason: str
    stop_sequence: Optional[str] = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int] = None


@dataclass(frozen=True)
class Keepalive:
    """The rank server is still reading the prompt (its ``: keepalive`` comment)."""


@dataclass(frozen=True)
class UpstreamError:
    """The rank server failed this answer mid-stream (its error event)."""

    message: str
    status: int = 500


Event = Union[Text, Reasoning, ToolCall, Finish, Usage, Keepalive, UpstreamError]


class StopMatcher:
    """Finds the first of ``stop_sequences`` in a text that arrives in
    pieces, holding back what could still begin one."""

    def __init__(self, stop_sequences: Sequence[str]):
        self.stops = [s for s in stop_sequences if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> Tuple[str, Optional[str]]:
        """(text safe to send now, the stop sequence met or None); after a match, nothing more is read."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, None
        found = [(self.pending.find(s), -len(s), s) for s in self.stops if s in self.pending]
        if found:
            at, _, stop = min(found)
            out, self.pending = self.pending[:at], ""
            return out, stop
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


async def chat_events(lines: AsyncIterator[str], stop_sequences: Sequence[str] = ()) -> AsyncIterator[Event]:
    """The rank server's streamed chat completion (its SSE lines) as events,
    ending with one ``Finish`` and, where the rank server sent it, one
    ``Usage``; stops reading at a stop sequence (the caller then closes
    the stream)."""
    matcher = StopMatcher(stop_sequences)
    finish: Optional[Finish] = None
    async for line in lines:
        if line.startswith(":"):
            yield Keepalive()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            yield UpstreamError(f"the rank server sent an unreadable event: {data[:80]!r}")
            return
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            code = error.get("code")
            yield UpstreamError(str(error.get("message", "the answer failed")), code if isinstance(code, int) else 500)
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            yield Usage(usage["prompt_tokens"], usage.get("completion_tokens") or 0, cached)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                yield Reasoning(delta["reasoning"])
            if delta.get("content"):
                text, stop = matcher.feed(delta["content"])
                if text:
                    yield Text(text)
                if stop is not None:
                    yield Finish("stop_sequence", stop)
                    return
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                yield ToolCall(str(call.get("id") or ""), str(function.get("name") or ""),
                               function.get("arguments") if isinstance(function.get("arguments"), str) else "{}")
            if choice.get("finish_reason"):
                finish = Finish(choice["finish_reason"])
    rest = matcher.flush()
    if rest:
        yield Text(rest)
    yield finish or Finish("stop")


async def close(stack: contextlib.AsyncExitStack) -> None:
    """Close ``stack`` (the rank server's stream, the live request) even
    from a task cancelled because its client left: the rank server then
    sees its connection close and ends the sequence on every rank."""
    with anyio.CancelScope(shield=True):
        await stack.aclose()


def live_request(upstream: Any) -> ContextManager[Any]:
    """The job's ``request()`` scope where it has one: the job grows back
    only while no request is live (``front/job.py``)."""
    request = getattr(getattr(upstream, "job", None), "request", None)
    return request() if request is not None else contextlib.nullcontext()


def arguments_object(arguments: str) -> Dict[str, Any]:
    """A tool call's JSON arguments as the object Anthropic's ``input`` is
    (a parser that gave something else: under ``"arguments"``)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
