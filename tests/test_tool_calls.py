"""Tool calls come back as tool calls: the official openai client against
``mlxdist.serve`` at np 2 under real mpirun, on a synthetic checkpoint whose
greedy answer to a tool-offering prompt is a known call
(``python -m mlxdist.synth DIR --preset qwen3_moe --tool-call``): parsed
with mlx-lm's tool parser, streamed and not, equal to mlx-lm's answer in
this process; a conversation with the call and its result answered. The
refusal of ``tools`` by a model without a tool parser is in test_serve.py,
on its server."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, mlx_lm_loaded
from mlxdist.synth.toolcall import TOOL_CALL, TOOL_CALL_MESSAGES, TOOL_CALL_TEXT, WEATHER_TOOL
from test_serve import KEY, Server

RESULT = "18 C, sunny"


@pytest.fixture(scope="module")
def tool_model(checkpoint):
    return checkpoint("qwen3_moe", tool_call=True)


@pytest.fixture(scope="module")
def client(tool_model):
    from openai import OpenAI

    s = Server(tool_model)
    yield OpenAI(base_url=s.url + "/v1", api_key=KEY)
    code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]


def alone(path, messages):
    """mlx-lm's greedy answer in this process, as its server renders the
    chat (tool calls' arguments as objects): the text, the calls its tool
    parser reads in it, the prompt's length."""
    from mlx_lm import generate

    from mlxdist.compat import process_message_content

    model, tokenizer = mlx_lm_loaded(str(path))
    messages = json.loads(json.dumps(messages))
    process_message_content(messages)
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=64)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    calls = [tokenizer.tool_parser(part.split(end)[0], [WEATHER_TOOL]) for part in text.split(start)[1:]]
    return text, calls, len(prompt)


def parsed(calls):
    assert all(c.type == "function" and c.id for c in calls), calls
    return [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]


def test_the_checkpoint_calls_the_tool_in_mlx_lm(tool_model):
    """The checkpoint's own claim, in mlx-lm alone: its tool parser is
    picked from the chat template, and the greedy answer is the call."""
    text, calls, _ = alone(tool_model, TOOL_CALL_MESSAGES)
    assert text == TOOL_CALL_TEXT and calls == [TOOL_CALL]


def test_a_tool_call_comes_back_parsed(client, tool_model):
    answer = client.chat.completions.create(model="any", messages=TOOL_CALL_MESSAGES, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=64)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _, calls, prompt_tokens = alone(tool_model, TOOL_CALL_MESSAGES)
    assert parsed(choice.message.tool_calls) == calls == [TOOL_CALL]
    assert answer.usage.prompt_tokens == prompt_tokens


def test_a_streamed_tool_call_comes_back_parsed(client, tool_model):
    chunks = list(client.chat.completions.create(model="any", messages=TOOL_CALL_MESSAGES, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=64, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in calls] == [0]
    assert parsed(calls) == alone(tool_model, TOOL_CALL_MESSAGES)[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_the_call_and_its_result_round_trip(client, tool_model):
    """The assistant's call as the client sends it back (arguments a JSON
    string) and the tool's result: accepted, rendered into the prompt as
    mlx-lm renders them, and answered as mlx-lm answers (this model calls
    the tool again: its answer hangs on the last token)."""
    first = client.chat.completions.create(model="any", messages=TOOL_CALL_MESSAGES, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=64).choices[0].message
    call = first.tool_calls[0]
    conversation = TOOL_CALL_MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    answer = client.chat.completions.create(model="any", messages=conversation, tools=[WEATHER_TOOL],
                                            temperature=0, max_tokens=64)
    text, calls, prompt_tokens = alone(tool_model, conversation)
    assert answer.usage.prompt_tokens == prompt_tokens  # the call and the result are in the prompt
    assert answer.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    assert parsed(answer.choices[0].message.tool_calls or []) == calls
    assert (answer.choices[0].message.content or "") == text.replace(TOOL_CALL_TEXT, "")


def test_malformed_calls_in_a_conversation_are_refused(client):
    """A call that is no object, or a name that is no string, is the
    request's 400 (before the schema checked them: a 500 from the ranks'
    tokenisation); a call without a name, one from the chat template."""
    from openai import BadRequestError

    for call in (5, {"id": "a", "type": "function", "function": {"name": 5, "arguments": "{}"}},
                 {"id": "a", "type": "function", "function": {"arguments": "{}"}}):
        messages = TOOL_CALL_MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]}]
        with pytest.raises(BadRequestError):
            client.chat.completions.create(model="any", messages=messages, tools=[WEATHER_TOOL], max_tokens=4)


def test_a_model_whose_head_is_its_embedding_is_refused(tmp_path):
    """--tool-call fits the output head: tied embeddings have none; one line, status 2."""
    written = subprocess.run([sys.executable, "-m", "mlxdist.synth", str(tmp_path), "--preset", "qwen3_moe",
                              "--tool-call", "--set", "tie_word_embeddings=true"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert written.returncode == 2 and "Traceback" not in written.stderr
    assert written.stderr.splitlines()[-1].endswith("needs a model with its own output head "
                                                    "(lm_head; tie_word_embeddings false)")
