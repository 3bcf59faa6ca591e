"""The front tokenises, templates and detokenises itself: on the
tool-calling checkpoint, the front (``--ranks 2``) and the rank server's
own HTTP API (np 2 under real mpirun, the same options) answer the same
requests alike, field for field but for ids and times: text and chat
completions, streamed and not, log-probabilities and the top ones, stop
words, answers cut at max_tokens, tool calls parsed as tool calls, a
request's own chat template, usage, the token count of Anthropic's
count_tokens, and each refusal. The rank server's token channel refuses
hostile bodies field by field with OpenAI-shaped 400s."""

import json

import pytest

from mlxdist.synth.toolcall import TOOL_CALL_MESSAGES, WEATHER_TOOL
from test_front import Front
from test_hostile import error_shaped
from test_serve import Server

OPTIONS = ["--allow-request-templates"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
OWN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
               "<|im_start|>assistant\n"
REQUESTS = {
    "text": ("/v1/completions", {"prompt": "Mixture of experts", "max_tokens": 12}),
    "text logprobs": ("/v1/completions", {"prompt": "Mixture of experts", "max_tokens": 6, "logprobs": True}),
    "chat top logprobs": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "logprobs": True,
                                                   "top_logprobs": 3}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 16}),
    "chat sampled": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0.8,
                                              "top_k": 5, "seed": 7}),
    "tool call": ("/v1/chat/completions", {"messages": TOOL_CALL_MESSAGES, "tools": [WEATHER_TOOL],
                                           "max_tokens": 64}),
    "own template": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                              "chat_template_kwargs": {"chat_template": OWN_TEMPLATE}}),
    "past the context": ("/v1/completions", {"prompt": "tokens " * 5000, "max_tokens": 8}),
    "refused field": ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}),
    "no messages": ("/v1/chat/completions", {"prompt": "Hi"}),
    "no prompt": ("/v1/completions", {"messages": CHAT}),
}


@pytest.fixture(scope="module")
def servers(checkpoint):
    """(the front, the rank server) on the tool-calling checkpoint."""
    path = checkpoint("qwen3_moe", tool_call=True)
    front = Front(path, OPTIONS)
    try:
        server = Server(path, extra=OPTIONS)
    except BaseException:
        front.kill()
        raise
    try:
        front.wait_for(("ok",))
        yield front, server
    finally:
        front.stop()
        server.stop()


def same_fields(answer):
    """An answer without what differs between two answers to one request: ids, times, the fingerprint."""
    if isinstance(answer, list):
        return [same_fields(a) for a in answer]
    if not isinstance(answer, dict):
        return answer
    return {k: same_fields(v) for k, v in answer.items() if k not in ("id", "created", "system_fingerprint")}


def chunks(text):
    """The data lines of an SSE answer, parsed ([DONE] as the string)."""
    lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def post_both(servers, path, body):
    front, server = servers
    status, _, got = front.post(path, body)
    want_status, want = server.post(path, body)
    return (status, got), (want_status, want)


@pytest.mark.parametrize("name", REQUESTS)
def test_answers_equal_the_rank_servers(servers, name):
    path, body = REQUESTS[name]
    (status, got), (want_status, want) = post_both(servers, path, body)
    assert status == want_status, (got, want)
    if status != 200:
        assert error_shaped(status, got) and got["error"]["message"] == want["error"]["message"], (got, want)
        return
    assert same_fields(got) == same_fields(want), (got, want)
    if name == "tool call":
        assert got["choices"][0]["finish_reason"] == "tool_calls"
        assert got["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    if name == "chat top logprobs":
        assert all(len(c["top_logprobs"]) == 3 for c in got["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("name", ["text", "chat", "tool call"])
def test_streams_equal_the_rank_servers(servers, name):
    path, body = REQUESTS[name]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    front, server = servers
    status, _, got = front.request("POST", path, body)
    want_status, want = server.request("POST", path, body)
    assert status == want_status == 200, (got, want)
    got, want = chunks(got), chunks(want)
    for chunk in got + want:  # tool calls' ids are new in every answer
        for choice in chunk["choices"] if isinstance(chunk, dict) else []:
            for call in choice.get("delta", {}).get("tool_calls", []):
                call.pop("id")
    assert same_fields(got) == same_fields(want)
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] > 0


def test_stop_words_end_the_answer_alike(servers):
    """A stop word taken from the greedy answer itself, so that it is met."""
    front, server = servers
    _, whole = server.post("/v1/completions", {"prompt": "Mixture of experts", "max_tokens": 24})
    text = whole["choices"][0]["text"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    assert word.strip(), text
    (status, got), (_, want) = post_both(servers, "/v1/completions",
                                         {"prompt": "Mixture of experts", "max_tokens": 24, "stop": [word]})
    assert status == 200 and same_fields(got) == same_fields(want)
    assert len(got["choices"][0]["text"]) < len(text) and got["choices"][0]["finish_reason"] == "stop"


def test_count_tokens_is_the_rank_servers_count(servers):
    front, server = servers
    status, _, counted = front.post("/v1/messages/count_tokens", {
        "model": "any", "messages": [{"role": "user", "content": "Name three rivers."}]})
    assert status == 200, counted
    want_status, want = server.post("/tokenize", {"messages": [{"role": "user", "content": "Name three rivers."}]})
    assert want_status == 200 and counted["input_tokens"] == want["count"]


@pytest.mark.parametrize("body, param", [
    ({"prompt_token_ids": [10 ** 9], "segments": [[10 ** 9]], "segment_types": ["assistant"],
      "initial_state": "normal", "chars": 1}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2], "segments": [[1]], "segment_types": ["assistant"], "initial_state": "normal",
      "chars": 1}, "segments"),
    ({"prompt_token_ids": [1], "segments": [[1]], "segment_types": ["tool"], "initial_state": "normal",
      "chars": 1}, "segment_types"),
    ({"prompt_token_ids": [1], "segments": [[1]], "segment_types": ["user"], "initial_state": "normal",
      "chars": 1, "messages": []}, "messages"),
    ({"prompt_token_ids": [1], "segments": [[1]], "segment_types": ["user"], "initial_state": "normal",
      "chars": 1, "max_tokens": 0}, "max_tokens"),
    ({"prompt_token_ids": [], "segments": [], "segment_types": [], "initial_state": "normal", "chars": 0},
     "prompt_token_ids"),
])
def test_the_token_channel_refuses_hostile_bodies(servers, body, param):
    _, server = servers
    status, answer = server.post("/mlxdist/tokens", body)
    assert error_shaped(status, answer) and answer["error"]["param"] == param, answer


def test_the_token_channel_wants_the_key(servers):
    _, server = servers
    status, answer = server.post("/mlxdist/tokens", {"prompt_token_ids": [1]}, key="wrong")
    assert status == 401 and answer["error"]["message"] == "missing or wrong API key", answer
