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
from mlxdist.front.messages import AnthropicAnswer
from mlxdist.front.messages_schema import IGNORED as MESSAGES_IGNORED, CountTokensRequest, MessagesRequest
from mlxdist.front.responses import ResponsesAnswer
from mlxdist.front.responses_schema import IGNORED as RESPONSES_IGNORED, REFUSED, ResponsesRequest
from mlxdist.front.store import ResponseStore
from mlxdist.front.translate import (
    AnswerFailed, Finish, Keepalive, Reasoning, StopMatcher, Text, ToolCall, UpstreamError, Usage, anthropic_to_chat,
    chat_events, read_body, responses_to_chat,
)

KEY = "agent-key-123"


# --- in process ---------------------------------------------------------------------------------------------------

def _messages(body):
    return MessagesRequest.model_validate(body)


def test_anthropic_request_as_chat():
    """System blocks, a tool_use turn and its tool_result (the tool message
    first, before the user's text), tools, tool_choice and sampling fields."""
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}]
    body = {"model": "claude", "max_tokens": 7, "system": system,
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
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
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
    ending = _messages({**body, "messages": [*body["messages"], {"role": "assistant", "content": "So"}]})
    assert anthropic_to_chat(ending, answering=False)["messages"][-1] == {"role": "assistant", "content": "So"}


@pytest.mark.parametrize("change, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type 'image' is not read here"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0]: a tool_use block belongs in an assistant message"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "run by Anthropic's servers"),
    ({"tools": [{"name": "t"}]}, "tools[0].input_schema: required"),
    ({"tool_choice": {"type": "tool"}}, "names the tool"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0]: a tool result's block of type 'image'"),
    ({"stop_sequences": ["x" * 257]}, "stop_sequences[0]: String should have at most 256 characters"),
    ({"stop_sequences": [""]}, "stop_sequences[0]: String should have at least 1 character"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20) + "y"}]}, "exceed the limit"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "{"}]}, "a prefill"),
])
def test_anthropic_request_refused(change, says):
    """Each refusal one line, as the route answers it (a schema error by first_error)."""
    from pydantic import ValidationError

    from mlxdist.front.messages_schema import first_error

    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **change}
    try:
        anthropic_to_chat(_messages(body))
    except ValidationError as e:
        said = first_error(e)
    except ValueError as e:
        said = str(e)
    else:
        raise AssertionError(f"not refused: {change}")
    assert says in said and "\n" not in said, said


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
USAGE = {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
         "prompt_tokens_details": {"cached_tokens": 12}}


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
                                  {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                   "input": {"city": "Paris"}}]
    with pytest.raises(AnswerFailed):
        answer.add(UpstreamError("lost", 503))

    thinking = AnthropicAnswer("claude", thinking=True)  # the request enabled thinking: reasoning is shown
    out = [e for event in (Reasoning("Hm"), Text("Hi"), Finish("stop")) for e in thinking.add(event)] + thinking.end()
    deltas = [json.loads(e.split("data: ", 1)[1]).get("delta", {}).get("type") for e in out]
    assert [d for d in deltas if d] == ["thinking_delta", "signature_delta", "text_delta"]
    assert thinking.message()["content"] == [{"type": "thinking", "thinking": "Hm", "signature": ""},
                                             {"type": "text", "text": "Hi"}]
    plain = AnthropicAnswer("claude")  # not enabled: not shown, as a model without thinking
    assert plain.add(Reasoning("Hm")) == [] and plain.message()["stop_reason"] == "end_turn"


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
                  {"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "Rain"}]}]})
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    conversation, chat = responses_to_chat(request, history)
    assert conversation[:2] == history and chat["messages"][0] == {"role": "system", "content": "Be terse."}
    assert conversation[2:] == [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"}]
    assert chat["max_tokens"] == 9 and chat["tools"][0]["function"]["name"] == "get_weather"

    answer = ResponsesAnswer(request)
    out = answer.start()
    for event in [Reasoning("Hm"), Reasoning("m."), Text("It"), Text(" is"),
                  ToolCall("call_9", "get_weather", '{"city": "Lima"}'), Finish("tool_calls"), Usage(30, 9, 12)]:
        out += answer.add(event)
    out += answer.end()
    assert _sse_types(out) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    numbers = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in out]
    assert numbers == list(range(len(out)))
    final = answer.response()
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert final["output"][1]["content"][0]["text"] == "It is" and final["output"][2]["call_id"] == "call_9"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 12} and final["status"] == "completed"
    assert answer.messages() == [{"role": "assistant", "content": "It is", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]}]


def test_a_job_lost_mid_answer_ends_each_stream_in_its_shape():
    """The rank job dropping the stream (``Unavailable`` from the upstream's
    lines) ends an Anthropic stream with an ``error`` event and a Responses
    stream with ``response.failed``, after what was already sent."""
    import contextlib

    from mlxdist.front import messages, responses
    from mlxdist.front.errors import Unavailable

    async def lost():
        yield Text("Hi")
        raise Unavailable("the rank job stopped answering (ReadError)")

    async def drain(stream):
        return [out async for out in stream]

    anthropic = asyncio.run(drain(messages._stream(AnthropicAnswer("m"), lost(), contextlib.AsyncExitStack(),
                                                   None, {})))
    assert _sse_types(anthropic)[-2:] == ["content_block_delta", "error"]
    error = json.loads(anthropic[-1].split("data: ", 1)[1])
    assert error["error"]["type"] == "overloaded_error" and "stopped answering" in error["error"]["message"]
    request = ResponsesRequest.model_validate({"input": "Hi"})
    store = ResponseStore(4)
    answer = ResponsesAnswer(request)
    out = asyncio.run(drain(responses._stream(answer, lost(), contextlib.AsyncExitStack(), store, request, [])))
    assert _sse_types(out)[-1] == "response.failed" and len(store) == 0
    failed = json.loads(out[-1].split("data: ", 1)[1])["response"]
    assert failed["status"] == "failed" and "stopped answering" in failed["error"]["message"]


@pytest.mark.parametrize("body, says", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "type 'input_image' is not read here"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "reads text only"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "type 'web_search' is not run here"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "must be JSON"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100000}]},
     "nests deeper than 64"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "9" * 5000}]}, "5000 digits"),
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


@pytest.mark.parametrize("value, says", [
    ("-1", "at least 0"), ("x", "ASCII digits"), ("", "ASCII digits"), ("\uff15", "ASCII digits"),
    ("1000001", "at most 1000000"), ("9" * 30, "at most 20 digits"),
])
def test_responses_store_option_refuses_hostile_values(value, says, capsys):
    from mlxdist.errors import UserError
    from mlxdist.front.settings import read_settings

    with pytest.raises((SystemExit, UserError)) as refused:
        read_settings(["--ranks", "2", "--responses-store", value])
    said = str(refused.value) if refused.type is UserError else capsys.readouterr().err.splitlines()[-1]
    assert says in said and (refused.type is UserError or refused.value.code == 2), said
    assert read_settings(["--ranks", "2", "--responses-store", "0"]).responses_store == 0
    assert read_settings(["--ranks", "2"]).responses_store == 1000


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


# --- served: one front at np 2 --------------------------------------------------------------------------------------

class Front:
    """``python -m mlxdist.serve --ranks 2`` on ``path``: the front, which starts the rank job itself."""

    def __init__(self, path, log, extra=()):  # extra: the rank server's options
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxdist.serve", "--ranks", "2", "--model", str(path), "--port", "0",
             "--api-key", KEY, "--heartbeat", "30", *map(str, extra)],
            env=mpirun_env(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(log, "w"), text=True, start_new_session=True)
        import httpx

        self.url = None
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the front exited: {self.said()}")
            found = re.search(r"front on (http://[\d.]+:\d+)", self.said())
            self.url = found.group(1) if found else None
            if self.url is None:
                time.sleep(0.5)
                continue
            try:
                health = httpx.get(self.url + "/health", headers={"authorization": f"Bearer {KEY}"}, timeout=5)
                if health.json().get("status") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the front's rank job did not start serving: {self.said()}")

    def said(self) -> str:
        with open(self.log) as f:
            return f.read()[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # Ctrl-C: the front stops its job
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_session(self.proc.pid)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def front(checkpoint, tmp_path_factory):
    """A front on a checkpoint that writes text."""
    served = Front(checkpoint("qwen3_moe"), tmp_path_factory.mktemp("front") / "stderr")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tool_front(checkpoint, tmp_path_factory):
    """A front on a checkpoint that calls get_weather (synth --tool-call)."""
    served = Front(checkpoint("qwen3_moe", tool_call=True), tmp_path_factory.mktemp("tool-front") / "stderr")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def dp_clients(checkpoint, tmp_path_factory):
    """Clients of a front whose rank job runs --mode dp."""
    served = Front(checkpoint("qwen3_moe"), tmp_path_factory.mktemp("dp-front") / "stderr", ["--mode", "dp"])
    yield _clients(served)
    served.stop()


def _clients(front):
    from anthropic import Anthropic
    from openai import OpenAI

    return (Anthropic(base_url=front.url, api_key=KEY, max_retries=0),
            OpenAI(base_url=front.url + "/v1", api_key=KEY, max_retries=0))


@pytest.fixture(scope="module")
def clients(front):
    return _clients(front)


@pytest.fixture(scope="module")
def tool_clients(tool_front):
    return _clients(tool_front)


def _weather_tools():
    from mlxdist.synth.toolcall import WEATHER_TOOL

    function = WEATHER_TOOL["function"]
    anthropic = [{"name": function["name"], "description": function["description"],
                  "input_schema": function["parameters"]}]
    responses = [{"type": "function", "name": function["name"], "description": function["description"],
                  "parameters": function["parameters"], "strict": False}]
    return WEATHER_TOOL, anthropic, responses


CONVERSATION = [{"role": "user", "content": "Tell me about the river."},
                {"role": "assistant", "content": "It moved slowly past the bridge."},
                {"role": "user", "content": "And the boat?"}]
SYSTEM = "You are a careful storyteller."


def _chat(openai_client, messages, max_tokens, **kw):
    answer = openai_client.chat.completions.create(model="any", messages=messages, max_tokens=max_tokens,
                                                   temperature=0, **kw)
    return answer


def test_messages_answer_as_chat_completions(clients):
    """The same conversation through /v1/messages, plain and streamed, gives
    chat completions' greedy text, its stop reason and its token counts."""
    anthropic, openai = clients
    chat = _chat(openai, [{"role": "system", "content": SYSTEM}, *CONVERSATION], 12)
    text, finish = chat.choices[0].message.content or "", chat.choices[0].finish_reason
    plain = anthropic.messages.create(model="claude-any", max_tokens=12, system=SYSTEM, messages=CONVERSATION,
                                      extra_body={"temperature": 0})  # as older clients send it
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == text
    assert plain.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert plain.usage.output_tokens == chat.usage.completion_tokens
    cached = plain.usage.cache_read_input_tokens
    assert cached is not None and plain.usage.input_tokens + cached == chat.usage.prompt_tokens
    assert cached > 0  # the same prompt a moment ago: mlx-lm's prompt cache, counted
    kinds = []
    with anthropic.messages.stream(model="claude-any", max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                                   messages=CONVERSATION) as stream:
        for event in stream:
            kinds.append(event.type)
        streamed = stream.get_final_message()
    assert streamed.content[0].text == text and streamed.stop_reason == plain.stop_reason
    assert streamed.usage.output_tokens == chat.usage.completion_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    count = anthropic.messages.count_tokens(model="claude-any", system=SYSTEM, messages=CONVERSATION)
    assert count.input_tokens == chat.usage.prompt_tokens
    silent = anthropic.messages.create(model="claude-any", max_tokens=0, system=SYSTEM, messages=CONVERSATION)
    assert (silent.content, silent.stop_reason, silent.usage.output_tokens) == ([], "max_tokens", 0)


def test_dp_answers_as_chat_completions(dp_clients):
    """Under --mode dp too: Messages and Responses, plain and streamed,
    give chat completions' greedy text; a repeated conversation's prompt is
    read from the rank that holds it (cache_read_input_tokens, cached_tokens)."""
    anthropic, openai = dp_clients
    chat = _chat(openai, [{"role": "system", "content": SYSTEM}, *CONVERSATION], 10)
    text = chat.choices[0].message.content or ""
    plain = anthropic.messages.create(model="m", max_tokens=10, system=SYSTEM, messages=CONVERSATION)
    assert "".join(b.text for b in plain.content) == text and plain.usage.cache_read_input_tokens > 0
    with anthropic.messages.stream(model="m", max_tokens=10, system=SYSTEM, messages=CONVERSATION) as stream:
        assert "".join(stream.text_stream) == text
    answer = openai.responses.create(model="m", instructions=SYSTEM, input=CONVERSATION, max_output_tokens=10)
    assert answer.output_text == text and answer.usage.input_tokens_details.cached_tokens > 0
    events = openai.responses.create(model="m", instructions=SYSTEM, input=CONVERSATION, max_output_tokens=10,
                                     stream=True)
    assert _output_text(list(events)) == text


def test_messages_stop_sequence(clients):
    """A stop sequence met in the text: the text before it, stop_reason
    stop_sequence naming it, in both forms."""
    anthropic, openai = clients
    text = _chat(openai, CONVERSATION, 16).choices[0].message.content
    stop = text[3:6]
    before = text[:text.index(stop)]
    plain = anthropic.messages.create(model="m", max_tokens=16, messages=CONVERSATION, stop_sequences=[stop, "\x01"])
    assert (plain.content[0].text if plain.content else "") == before
    assert (plain.stop_reason, plain.stop_sequence) == ("stop_sequence", stop)
    assert plain.usage.output_tokens > 0 and plain.usage.input_tokens > 0
    with anthropic.messages.stream(model="m", max_tokens=16, messages=CONVERSATION, stop_sequences=[stop]) as s:
        streamed = s.get_final_message()
    assert "".join(b.text for b in streamed.content) == before and streamed.stop_sequence == stop


def test_messages_tool_call_and_result(tool_clients):
    """The checkpoint's call comes back as a tool_use block (plain and
    streamed, with input_json_delta); sent back with a tool_result, the
    next turn equals chat completions of the same conversation."""
    from mlxdist.synth.toolcall import TOOL_CALL, TOOL_CALL_MESSAGES

    anthropic, openai = tool_clients
    chat_tool, tools, _ = _weather_tools()
    plain = anthropic.messages.create(model="m", max_tokens=64, messages=TOOL_CALL_MESSAGES, tools=tools)
    assert plain.stop_reason == "tool_use"
    uses = [b for b in plain.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [(TOOL_CALL["name"], TOOL_CALL["arguments"])] and uses[0].id
    deltas = []
    with anthropic.messages.stream(model="m", max_tokens=64, messages=TOOL_CALL_MESSAGES, tools=tools) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        streamed = stream.get_final_message()
    assert json.loads("".join(deltas)) == TOOL_CALL["arguments"]
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]

    result = "18 C, sunny"
    turn = anthropic.messages.create(model="m", max_tokens=64, tools=tools, messages=[
        *TOOL_CALL_MESSAGES,
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name,
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]}])
    chat = _chat(openai, [*TOOL_CALL_MESSAGES,
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": uses[0].id, "type": "function", "function": {
                                  "name": uses[0].name, "arguments": json.dumps(uses[0].input)}}]},
                          {"role": "tool", "tool_call_id": uses[0].id, "content": result}], 64, tools=[chat_tool])
    message = chat.choices[0].message
    assert "".join(b.text for b in turn.content if b.type == "text") == (message.content or "")
    assert [(b.name, b.input) for b in turn.content if b.type == "tool_use"] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert turn.usage.input_tokens + (turn.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens


def _output_text(events):
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_responses_answer_as_chat_completions(clients):
    """/v1/responses, plain and streamed, gives chat completions' greedy
    text; previous_response_id continues a stored conversation as if it
    were sent whole; store: false keeps nothing."""
    _, openai = clients
    first_turn = CONVERSATION[:1]
    chat = _chat(openai, [{"role": "system", "content": SYSTEM}, *first_turn], 10)
    plain = openai.responses.create(model="any", instructions=SYSTEM, input=first_turn[0]["content"],
                                    max_output_tokens=10, temperature=0)
    assert plain.output_text == chat.choices[0].message.content
    assert plain.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
    assert plain.usage.output_tokens == chat.usage.completion_tokens
    events = list(openai.responses.create(model="any", instructions=SYSTEM, input=first_turn, max_output_tokens=10,
                                          temperature=0, stream=True))
    assert _output_text(events) == plain.output_text
    assert events[0].type == "response.created" and events[-1].type == f"response.{plain.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))

    follow = {"role": "user", "content": "And the boat?"}
    chained = openai.responses.create(model="any", previous_response_id=plain.id, input=[follow], max_output_tokens=10)
    whole = _chat(openai, [*first_turn, {"role": "assistant", "content": plain.output_text}, follow], 10)
    assert chained.output_text == whole.choices[0].message.content  # the instructions were the first turn's own
    unstored = openai.responses.create(model="any", input="Hello", max_output_tokens=2, store=False)
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        openai.responses.create(model="any", previous_response_id=unstored.id, input="Again", max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id"


def test_responses_tool_call_and_output(tool_clients):
    """The call as a function_call item (plain, and streamed with its
    arguments' events); its output sent back, with previous_response_id or
    the whole conversation, gives chat completions' next turn."""
    from mlxdist.synth.toolcall import TOOL_CALL, TOOL_CALL_MESSAGES

    _, openai = tool_clients
    chat_tool, _, tools = _weather_tools()
    plain = openai.responses.create(model="any", input=TOOL_CALL_MESSAGES, tools=tools, max_output_tokens=64)
    calls = [item for item in plain.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(TOOL_CALL["name"], TOOL_CALL["arguments"])]
    events = list(openai.responses.create(model="any", input=TOOL_CALL_MESSAGES, tools=tools, max_output_tokens=64,
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [TOOL_CALL["arguments"]]
    assert events[-1].type == "response.completed"

    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}
    chained = openai.responses.create(model="any", previous_response_id=plain.id, input=[output], tools=tools,
                                      max_output_tokens=64)
    whole = openai.responses.create(model="any", tools=tools, max_output_tokens=64, store=False, input=[
        *TOOL_CALL_MESSAGES, {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                              "arguments": calls[0].arguments}, output])
    chat = _chat(openai, [*TOOL_CALL_MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].call_id, "type": "function",
         "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 C, sunny"}], 64, tools=[chat_tool])
    expected = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []]
    for answer in (chained, whole):
        assert answer.output_text == (chat.choices[0].message.content or "")
        assert [(i.name, i.arguments) for i in answer.output if i.type == "function_call"] == expected
        assert answer.usage.input_tokens == chat.usage.prompt_tokens


def _post(front, path, raw, headers=None):
    import httpx

    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}", **(headers or {})}
    return httpx.post(front.url + path, content=raw, headers=headers, timeout=120)


def test_keys_and_hostile_bodies(front):
    """x-api-key or the bearer token; without either a 401 in each API's
    shape; hostile bodies a 4xx with one line, in Anthropic's error shape
    on /v1/messages and OpenAI's on /v1/responses."""
    ok = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).encode()
    assert _post(front, "/v1/messages", ok, {"authorization": "", "x-api-key": KEY}).status_code == 200
    wrong = _post(front, "/v1/messages", ok, {"authorization": "", "x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert _post(front, "/v1/responses", b'{"input": "Hi"}', {"authorization": ""}).json()["error"]["code"] == 401

    deep = b'{"model": "m", "max_tokens": 2, "messages": ' + b"[" * 70 + b"]" * 70 + b"}"
    messages_cases = [
        (ok, {"content-type": "text/plain"}, 415, "must be JSON"),
        (b"{" + b" " * (5 << 20) + b"}", {}, 413, "exceeds the limit"),
        (deep, {}, 400, "nests deeper than 64"),
        (b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "video"}]}]}', {}, 400,
         "type 'video' is not read here"),
        (ok[:-1] + b', "frobnicate": 1}', {}, 400, "frobnicate: unknown field"),
        (ok.replace(b'"max_tokens": 2', b'"max_tokens": 99999999'), {}, 400, "max_tokens must be in"),
        (ok.replace(b'"max_tokens": 2', b'"max_tokens": -1'), {}, 400, "max_tokens"),
        (ok.replace(b'"Hi"', b'"\\ud800"'), {}, 400, "lone surrogate"),
    ]
    for raw, headers, status, says in messages_cases:
        answer = _post(front, "/v1/messages", raw, headers)
        body = answer.json()
        assert answer.status_code == status and body["type"] == "error", (says, answer.text[:300])
        assert says in body["error"]["message"] and "\n" not in body["error"]["message"], (says, body)
    responses_cases = [
        (b'{"input": [{"type": "computer_call_output", "call_id": "c"}]}', 400, "not read here"),
        (b'{"input": "x", "max_output_tokens": "9"}', 400, "max_output_tokens"),
        (b'{"input": "x", "background": true}', 400, "background"),
        (b'{"input": "x", "tools": [{"type": "file_search"}]}', 400, "is not run here"),
    ]
    for raw, status, says in responses_cases:
        answer = _post(front, "/v1/responses", raw)
        error = answer.json()["error"]
        assert answer.status_code == status and says in error["message"], (says, answer.text[:300])
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    refused = _post(front, "/v1/messages", ok[:-1] + b', "tools": ' + json.dumps(tools).encode() + b"}")
    assert refused.status_code == 400 and "does not call tools" in refused.json()["error"]["message"]
    refused = _post(front, "/v1/responses", b'{"input": "x", "tools": [{"type": "function", "name": "f"}]}')
    assert refused.status_code == 400 and "does not call tools" in refused.json()["error"]["message"]

    def metrics():
        import httpx

        text = httpx.get(front.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
        return {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in (
            "mlxdist_prompt_tokens_total", "mlxdist_time_to_first_token_seconds_count",
            "mlxdist_request_seconds_count", "mlxdist_requests_running")}

    before = metrics()
    answered = _post(front, "/v1/messages", ok)  # and it still answers, observed in /metrics
    assert answered.status_code == 200
    usage = answered.json()["usage"]
    after = metrics()
    assert after["mlxdist_prompt_tokens_total"] - before["mlxdist_prompt_tokens_total"] == (
        usage["input_tokens"] + usage.get("cache_read_input_tokens", 0))
    assert after["mlxdist_time_to_first_token_seconds_count"] == before["mlxdist_time_to_first_token_seconds_count"] + 1
    assert after["mlxdist_request_seconds_count"] == before["mlxdist_request_seconds_count"] + 1
    assert after["mlxdist_requests_running"] == 0


def test_the_count_is_the_template_and_tokenizer(checkpoint):
    """serving/tokenize.py counts what mlx-lm's server would prompt with
    (the chat template, the tools, no special tokens added to a text), and
    never renders a request's own template (that is templates.py's, in its
    sandbox)."""
    from functools import partial

    from mlx_lm.utils import load_tokenizer

    from mlxdist.errors import RequestError
    from mlxdist.serving.tokenize import count_tokens
    from mlxdist.synth.toolcall import TOOL_CALL_MESSAGES, WEATHER_TOOL

    path = checkpoint("qwen3_moe", tool_call=True)
    tokenizer = load_tokenizer(path)
    count = partial(count_tokens, tokenizer, context_length=4096)
    counted = count({"messages": TOOL_CALL_MESSAGES, "tools": [WEATHER_TOOL]})
    prompt = tokenizer.apply_chat_template(TOOL_CALL_MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert counted == {"count": len(prompt), "max_model_len": 4096}
    assert count({"messages": TOOL_CALL_MESSAGES})["count"] < len(prompt)  # the tools count
    assert count({"prompt": "Hello there"})["count"] == len(
        tokenizer.encode("Hello there", add_special_tokens=False))
    with pytest.raises(RequestError, match="own chat template"):
        count({"messages": TOOL_CALL_MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    with pytest.raises(RequestError, match="still loading"):
        count_tokens(None, {"prompt": "Hello"}, 4096)


def test_not_serving_is_a_503_in_each_apis_shape():
    """While the rank job does not serve (loading, recovering), both APIs
    answer 503 with Retry-After, in their own error shapes (the routes in
    process, over an Upstream whose job has no address)."""
    import types

    import httpx
    from fastapi import FastAPI

    from mlxdist.front import messages, responses
    from mlxdist.front.upstream import Upstream

    upstream = Upstream(types.SimpleNamespace(base_url=None, state="recovering"), retry_after=7)
    app = FastAPI()
    app.include_router(messages.router(upstream))
    app.include_router(responses.router(upstream, ResponseStore(4)))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
            return [await client.post("/v1/messages", json=body),
                    await client.post("/v1/messages", json={**body, "stream": True}),
                    await client.post("/v1/messages/count_tokens", json={"model": "m", "messages": body["messages"]}),
                    await client.post("/v1/responses", json={"input": "Hi"}),
                    await client.post("/v1/responses", json={"input": "Hi", "stream": True})]

    answers = asyncio.run(ask())
    assert [a.status_code for a in answers] == [503] * 5
    assert all(a.headers["retry-after"] == "7" for a in answers)
    for answer in answers[:3]:
        error = answer.json()["error"]
        assert error["type"] == "overloaded_error" and "starting again" in error["message"]
    for answer in answers[3:]:
        assert answer.json()["error"]["code"] == 503 and "starting again" in answer.json()["error"]["message"]
    asyncio.run(upstream.aclose())


def test_requests_shaped_as_claude_code_and_codex_send_them(tool_front):
    """Bodies and headers as the agents send them (Claude Code: the beta
    query, anthropic-version and anthropic-beta headers, x-api-key, system
    blocks with cache_control, JSON-schema tools, metadata, thinking,
    context_management; Codex: developer instructions, reasoning and
    include, store false, prompt_cache_key, text verbosity): accepted,
    and the call comes back streamed."""
    import httpx

    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
              "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}
    claude = {
        "model": "claude-sonnet-4-5", "max_tokens": 64, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
            {"type": "text", "text": "What is the weather in Paris?", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": schema},
                  {"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}],
        "metadata": {"user_id": "user_abc_account_def_session_ghi"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    }
    headers = {"content-type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", tool_front.url + "/v1/messages?beta=true", json=claude, headers=headers,
                      timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        events = [line[7:] for line in answer.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_start" in events

    codex = {
        "model": "gpt-5-codex", "instructions": "You are Codex.", "stream": True, "store": False,
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "cwd: /"}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Run a command", "strict": False,
                   "parameters": schema},
                  {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-session", "text": {"verbosity": "low"},
    }
    with httpx.stream("POST", tool_front.url + "/v1/responses", json=codex,
                      headers={"authorization": f"Bearer {KEY}"}, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        data = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1]["type"] == "response.completed"
    assert [i["type"] for i in data[-1]["response"]["output"]] == ["function_call"]
