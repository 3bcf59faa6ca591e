"""The server's prompt cache in both modes at np = 2 under real mpirun
(``--mode collective``: mlx-lm's cache, the same on every rank;
``--mode dp``: one per rank and cache-aware routing): a second turn that
extends a long conversation reports its cached tokens in ``usage``
(completions and chat, streamed with include_usage and not), starts in at
most a tenth of the first turn's time (time to first token, from the client)
and answers the greedy text of an uncached run (mlx-lm alone). Also the
routing rule and ``--prompt-cache-bytes``'s hostile values, in process."""

import http.client
import json
import time

import pytest

from test_serve import KEY, Server, alone

MAX_TOKENS = 8
STORY = "Story: " + " ".join(f"w{i % 97} alpha beta" for i in range(140))  # 1,250 tokens of the synthetic tokenizer
SYSTEM = "You answer questions about this log. " + " ".join(f"line {i}: ok" for i in range(100))  # ~900 tokens


@pytest.fixture(scope="module", params=["collective", "dp"])
def server(request, checkpoint):
    s = Server(checkpoint("qwen3_moe"), extra=["--mode", request.param])
    yield s
    code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]


def streamed(server, path, body):
    """A streamed request with include_usage: (seconds to the first text
    from sending it, the text, the usage event's usage)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    tic = time.perf_counter()
    connection.request("POST", path, payload, {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = connection.getresponse()
    assert response.status == 200, response.read()[:500]
    first, text, usage = None, "", None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - tic
            text += piece
    connection.close()
    assert first is not None and usage is not None, (text, usage)
    return first, text, usage


def posted(server, path, body):
    """A request not streamed: (its text, its usage)."""
    status, answer = server.post(path, body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return choice.get("text", (choice.get("message") or {}).get("content")), answer["usage"]


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_second_turn_starts_from_the_cache(server, checkpoint):
    """Completions: turn 1 (1,250 tokens) reads nothing from the cache; turn
    2, turn 1 and its answer extended, reads turn 1's tokens from it, starts
    in at most a tenth of turn 1's time, and answers mlx-lm's greedy text
    for its whole prompt alone; the same request not streamed too."""
    first_seconds, answer, usage = streamed(server, "/v1/completions", {"prompt": STORY, "max_tokens": MAX_TOKENS})
    assert cached(usage) == 0, usage
    turn2 = STORY + answer + " and then the end"
    second_seconds, text, usage2 = streamed(server, "/v1/completions", {"prompt": turn2, "max_tokens": MAX_TOKENS})
    assert cached(usage2) >= usage["prompt_tokens"] - 2, (usage, usage2)  # the tail may tokenise otherwise
    assert second_seconds <= first_seconds / 10, (first_seconds, second_seconds)
    expected = alone(checkpoint("qwen3_moe"), turn2, MAX_TOKENS)
    assert text == expected
    again, usage3 = posted(server, "/v1/completions", {"prompt": turn2, "max_tokens": MAX_TOKENS})
    assert again == expected and cached(usage3) >= cached(usage2), usage3


def test_chat_turns_report_cached_tokens(server):
    """Chat completions: a second conversation's first turn shares nothing
    with the first's (0 cached; under dp it goes to the rank that holds
    nothing); its second turn reads the first from the cache, streamed and
    not, with the same text; the first conversation's cache is still where
    its third turn finds it."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which lines are ok?"}]
    answer, usage = posted(server, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS})
    assert cached(usage) == 0, usage
    turn2 = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And line 7?"}]
    _, text, usage2 = streamed(server, "/v1/chat/completions", {"messages": turn2, "max_tokens": MAX_TOKENS})
    assert cached(usage2) >= usage["prompt_tokens"] - 2, (usage, usage2)
    again, usage3 = posted(server, "/v1/chat/completions", {"messages": turn2, "max_tokens": MAX_TOKENS})
    assert again == text and cached(usage3) >= cached(usage2), usage3
    _, usage4 = posted(server, "/v1/completions", {"prompt": STORY + " and so on", "max_tokens": MAX_TOKENS})
    assert cached(usage4) >= 1000, usage4  # the story's tokens, kept since the first test


def test_the_routing_rule():
    """serving/dp_prompt_cache.route: the rank holding the longest prefix
    gets a request unless the prefix is short or that rank is far busier;
    else the least loaded, then the one holding more of the prompt, then
    the one whose cache holds fewer bytes."""
    from mlxdist.serving.dp_prompt_cache import route

    assert route([0, 900], [0, 0], [10, 10], 1000) == 1  # the prefix holder
    assert route([0, 900], [3, 8], [10, 10], 1000) == 1  # busier, not far busier: 8 <= 2 x 3 + 4
    assert route([0, 900], [3, 11], [10, 10], 1000) == 0  # far busier: 11 > 2 x 3 + 4
    assert route([0, 20], [1, 1], [10, 10], 1000) == 1  # too short to route for: tie on load, more held
    assert route([0, 20], [0, 1], [10, 10], 1000) == 0  # too short to route for: the least loaded
    assert route([0, 300], [0, 1], [10, 10], 4000) == 1  # 256 tokens is enough in a long prompt
    assert route([0, 6], [0, 1], [10, 10], 10) == 1  # half a short prompt is enough
    assert route([0, 0], [0, 0], [500, 0], 10) == 1  # nothing held: the emptier cache
    assert route([0, 0, 0], [2, 1, 1], [0, 9, 5], 10) == 2
    assert route([700, 700], [1, 1], [0, 0], 1000) == 0  # ties: the lower rank


@pytest.mark.parametrize("value,why", [
    ("-1", "ASCII digits"), ("1.5G", "ASCII digits"), ("", "ASCII digits"), ("８", "ASCII digits"),
    ("8g", "ASCII digits"), ("9" * 30, "ASCII digits"), ("17T", "at most"), ("99999999999999999999", "at most"),
])
def test_prompt_cache_bytes_refuses_hostile_values(value, why, capsys):
    """--prompt-cache-bytes: one line naming the option, status 2."""
    from mlxdist.cli.serve import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--prompt-cache-bytes", value])
    assert stop.value.code == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert len(lines) == 1 and "--prompt-cache-bytes" in lines[0] and why in lines[0], lines
    assert build_parser().parse_args(["--prompt-cache-bytes", "0"]).prompt_cache_bytes == 0
    assert build_parser().parse_args([]).prompt_cache_bytes == 8 << 30
