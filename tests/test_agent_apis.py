"""Anthropic's Messages API and OpenAI's Responses API on the front
(mlxdist/front/messages.py, responses.py, translate.py, store.py).

In process (fast): the translation of each API's requests into a chat
completion and of the rank server's streamed answer back, the store, and
that every field the official clients can send is read or knowingly
ignored. Served (one front at np 2 for the module, ``python -m mlxdist.serve
--ranks 2``, on a checkpoint that calls a tool): with the official
``anthropic`` and ``openai`` clients, plain and streamed answers equal to
chat completions of the same conversation at temperature 0, the tool call
parsed, a conversation with tool results, ``previous_response_id``,
token counts, stop sequences, the API key either way, and hostile bodies
answered 4xx in each API's own error shape.
"""

import asyncio
import json
import re
import subprocess
import sys
import time
import typing

import pytest

from conftest import ROOT, kill_session, mpirun_env
from mlxdist.front.messages import AnswerFailed, AnthropicAnswer
from mlxdist.front.messages_schema import IGNORED as MESSAGES_IGNORED, CountTokensRequest, MessagesRequest
from mlxdist.front.responses import ResponsesAnswer
from mlxdist.front.responses_schema import IGNORED as RESPONSES_IGNORED, REFUSED, ResponsesRequest
from mlxdist.front.store import ResponseStore
from mlxdist.front.translate import (
    Finish, Keepalive, StopMatcher, Text, ToolCall, UpstreamError, Usage, anthropic_to_chat, chat_events,
    read_body, responses_to_chat,
)

KEY = "agent-key-123"


# --- in process ---------------------------------------------------------------------------------------------------

def _messages(body):
    return MessagesRequest.model_validate(body)


def test_anthropic_request_as_chat():
    """System blocks, a tool_use turn and its tool_result (the tool message
    first, before the user's text), tools, tool_choice and sampling fields."""
    body = {"model": "claude", "max_tokens": 7, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "text", "text": "Thanks"},
                                             {"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "Sunny"}]}]}],
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "temperature": 0.5, "top_k": 3, "stop_sequences": ["END"]}
    chat = anthropic_to_chat(_messages(body))
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                                               "description": "d"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert (chat["temperature"], chat["top_k"], chat["max_tokens"]) == (0.5, 3, 7)
    assert "stop" not in chat and chat["stream"] and chat["stream_options"] == {"include_usage": True}
    none = anthropic_to_chat(_messages({**body, "tool_choice": {"type": "none"}}))
    assert "tools" not in none and "tool_choice" not in none  # "none": the model is not shown them
    named = anthropic_to_chat(_messages({**body, "tool_choice": {"type": "tool", "name": "get_weather"}}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert anthropic_to_chat(_messages({**body, "max_tokens": 0}))["max_tokens"] == 1  # read the prompt only


@pytest.mark.parametrize("change, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type 'image' is not read here"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "belongs in an assistant message"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "run by Anthropic's servers"),
    ({"tools": [{"name": "t"}]}, "tools[0].input_schema: required"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20) + "y"}]}, "exceed the limit"),
])
def test_anthropic_request_refused(change, says):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    with pytest.raises(ValueError, match=re.escape(says)):
        anthropic_to_chat(_messages(body))


def test_read_body_refuses_as_the_rank_server():
    for raw, says in [(b"[1]", "must be a JSON object"), (b"\xff", "not valid UTF-8"),
                      (b'{"a":' * 65 + b"1" + b"}" * 65, "nests deeper than 64"),
                      (b'{"a": 1e999}', "no number mlxdist reads"), (b'{"a": "\\ud800"}', "lone surrogate"),
                      (b'{"a": ' + b"9" * 200 + b"}", "integer of 200 digits")]:
        with pytest.raises(ValueError, match=says):
            read_body(raw)


def _lines(*chunks, usage=None, keepalive=True):
    """The SSE lines the rank server streams: chunks (a dict: the choice's delta and finish)."""
    out = [": keepalive 3/3", ""] if keepalive else []
    for chunk in chunks:
        out += ["data: " + json.dumps({"object": "chat.completion.chunk", "choices": [chunk]}), ""]
    if usage is not None:
        out += ["data: " + json.dumps({"object": "chat.completion", "choices": [], "usage": usage}), ""]
    return out + ["data: [DONE]", ""]


def _events(lines, stops=()):
    async def run():
        async def source():
            for line in lines:
                yield line

        return [e async for e in chat_events(source(), stops)]

    return asyncio.run(run())


CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USAGE = {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39, "prompt_tokens_details": {"cached_tokens": 12}}


def test_chat_events_and_stop_sequences():
    lines = _lines({"delta": {"content": "Hel"}}, {"delta": {"content": "lo EN"}}, {"delta": {"content": "D there"}},
                   {"delta": {"tool_calls": [CALL]}}, {"delta": {}, "finish_reason": "tool_calls"}, usage=USAGE)
    assert _events(lines) == [Keepalive(), Text("Hel"), Text("lo EN"), Text("D there"),
                              ToolCall("call_1", "get_weather", '{"city": "Paris"}'), Usage(30, 9, 12),
                              Finish("tool_calls")]
    cut = _events(lines, ["END", "zzz"])  # met across two chunks: text before it, held back until decided
    assert cut == [Keepalive(), Text("H"), Text("ello "), Finish("stop_sequence", "END")]
    matcher = StopMatcher(["ab", "b"])
    assert matcher.feed("xa") == ("x", None) and matcher.feed("b") == ("", "ab")  # the earliest, then the longer
    error = _lines({"delta": {"content": "a"}}) [:4] + ['data: {"error": {"message": "lost", "code": 503}}']
    assert _events(error)[-1] == UpstreamError("lost", 503)


def _sse_types(out):
    return [re.match(r"event: (\S+)", e).group(1) for e in out if e.startswith("event:")]


def test_anthropic_answer_events():
    answer = AnthropicAnswer("claude")
    out = answer.start()
    for event in [Keepalive(), Text("Hi"), Text(" you"), ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                  Finish("tool_calls"), Usage(30, 9, 12)]:
        out += answer.add(event)
    out += answer.end()
    assert _sse_types(out) == ["message_start", "ping", "ping", "content_block_start", "content_block_delta",
                               "content_block_delta", "content_block_stop", "content_block_start",
                               "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    data = [json.loads(e.split("data: ", 1)[1]) for e in out]
    assert data[7]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert data[8]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert data[10]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data[10]["usage"] == {"input_tokens": 18, "output_tokens": 9, "cache_read_input_tokens": 12}
    message = answer.message()
    assert message["content"] == [{"type": "text", "text": "Hi you"},
                                  {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    with pytest.raises(AnswerFailed):
        answer.add(UpstreamError("lost", 503))


def test_responses_request_as_chat_and_answer_events():
    request = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 9, "reasoning": {"effort": "low"},
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}],
        "input": [{"role": "developer", "content": "Use tools."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                  {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]}]})
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    conversation, chat = responses_to_chat(request, history)
    assert conversation[:2] == history and chat["messages"][0] == {"role": "system", "content": "Be terse."}
    assert conversation[2:] == [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "Rain"}]
    assert chat["max_tokens"] == 9 and chat["tools"][0]["function"]["name"] == "get_weather"

    answer = ResponsesAnswer(request)
    out = answer.start()
    for event in [Text("It"), Text(" is"), ToolCall("call_9", "get_weather", '{"city": "Lima"}'), Finish("tool_calls"),
                  Usage(30, 9, 12)]:
        out += answer.add(event)
    out += answer.end()
    assert _sse_types(out) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    numbers = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in out]
    assert numbers == list(range(len(out)))
    final = answer.response()
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "It is" and final["output"][1]["call_id"] == "call_9"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 12} and final["status"] == "completed"
    assert answer.messages() == [{"role": "assistant", "content": "It is", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]}]


@pytest.mark.parametrize("body, says", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "type 'input_image' is not read here"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "reads text only"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "type 'web_search' is not run here"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "must be JSON"),
    ({"input": []}, "needs at least one message"),
])
def test_responses_request_refused(body, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        responses_to_chat(ResponsesRequest.model_validate({"model": "m", **body}))


def test_response_store_bounds():
    store = ResponseStore(2, max_chars=10)
    store.put("a", [{"role": "user", "content": "1234"}])
    store.put("b", [{"role": "user", "content": "12"}])
    assert store.get("a") is not None  # a used last: b goes first
    store.put("c", [{"role": "user", "content": "1"}])
    assert (store.get("b"), len(store)) == (None, 2)
    store.put("d", [{"role": "user", "content": "123456"}])  # 4 + 1 + 6 > 10: the least used goes
    assert store.get("a") is None and store.get("d") is not None and store.chars <= 10
    store.put("e", [{"role": "user", "content": "x" * 11}])  # larger than the whole store: not kept
    assert store.get("e") is None
    assert ResponseStore(0).capacity == 0 and (ResponseStore(0).put("a", []), len(ResponseStore(0))) == (None, 0)


def _client_fields(typed) -> set:
    return set(typing.get_type_hints(typed, include_extras=False))


def test_every_field_the_clients_send_is_read_or_ignored():
    """A field the installed client can send that this server neither reads
    nor knowingly ignores would be a 400 for its users: none may be left."""
    from anthropic.types import message_count_tokens_params, message_create_params
    from anthropic.types.beta import message_create_params as beta_create_params
    from openai.types.responses import response_create_params

    def known(model, ignored):
        return set(model.model_fields) | set(ignored)

    for typed in (message_create_params.MessageCreateParamsNonStreaming,
                  message_create_params.MessageCreateParamsStreaming,
                  beta_create_params.MessageCreateParamsNonStreaming):
        assert _client_fields(typed) - known(MessagesRequest, MESSAGES_IGNORED) == set()
    assert _client_fields(message_count_tokens_params.MessageCountTokensParams) - known(
        CountTokensRequest, MESSAGES_IGNORED) == set()
    for typed in (response_create_params.ResponseCreateParamsNonStreaming,
                  response_create_params.ResponseCreateParamsStreaming):
        assert _client_fields(typed) - known(ResponsesRequest, (*RESPONSES_IGNORED, *REFUSED)) == set()
