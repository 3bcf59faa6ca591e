"""Speculative decoding of one prompt (engine/speculative.py, mlx-lm's
speculative loop): drafted tokens are verified by the distributed model,
several per forward. Greedy text is the model's own: tokens equal to plain
greedy decoding in the exact modes, for N = 1 to 3, with a draft model (the
checkpoint itself: it agrees by construction, so every draft is kept and a
forward yields num_draft_tokens + 1 tokens) and with prompt lookup."""

import json

import pytest

from conftest import last_json, launch
from test_api import mlx_lm_alone

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat sat"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def plain(checkpoint):
    """Plain greedy decoding of the raw prompt: mlx-lm's own."""
    return mlx_lm_alone(checkpoint("qwen3_moe"), PROMPT, MAX_TOKENS)


@pytest.mark.parametrize("nranks,dispatch", [(0, "collective"), (2, "collective"), (3, "p2p")])
def test_greedy_with_a_draft_model_is_plain_greedy(checkpoint, plain, nranks, dispatch):
    path = checkpoint("qwen3_moe")
    proc = launch(nranks, ["--model", path, "-p", PROMPT, "-m", MAX_TOKENS, "--json", "--ignore-chat-template",
                           "--mode", dispatch, "--draft-model", path, "--num-draft-tokens", 3])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["tokens"] == plain
    assert out["tokens_per_forward"] == MAX_TOKENS / (MAX_TOKENS - out["draft_tokens_accepted"])
    assert out["tokens_per_forward"] > 3.0  # the draft agrees: up to 4 tokens a forward


@pytest.mark.parametrize("nranks,dispatch", [(2, "p2p"), (3, "collective")])
def test_greedy_with_prompt_lookup_is_plain_greedy(checkpoint, plain, nranks, dispatch):
    path = checkpoint("qwen3_moe")
    proc = launch(nranks, ["--model", path, "-p", PROMPT, "-m", MAX_TOKENS, "--json", "--ignore-chat-template",
                           "--mode", dispatch, "--prompt-lookup-ngram", 2, "--num-draft-tokens", 4])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["tokens"] == plain


def seen(tokens, ngram=3):
    from mlxdist.engine.speculative import TokenHistory

    history = TokenHistory(ngram)
    history.extend(tokens)
    return history


def scanned(tokens, ngram):
    """The lookup by a scan of the whole context (what the index replaces)."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n]
    return tokens[-1]


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    from mlxdist.engine.speculative import PromptLookup

    lookup = PromptLookup(3, 100)
    assert lookup.predict(seen([1, 2, 3, 9, 1, 2, 3])) == 9  # the 3-gram seen before
    assert lookup.predict(seen([5, 2, 3, 7, 4, 2, 3])) == 7  # no 3-gram: the 2-gram
    assert lookup.predict(seen([1, 2, 3, 4])) == 4  # nothing seen before: the last token
    assert lookup.predict(seen([8, 1, 8, 2, 8])) == 2  # the latest occurrence wins


def test_the_ngram_index_answers_as_a_scan_through_trims():
    """Random contexts grown and trimmed as mlx-lm rewinds a draft's cache:
    every lookup equals the scan's."""
    import random

    from mlxdist.engine.speculative import PromptLookup

    rng = random.Random(0)
    for ngram in (1, 2, 3, 5):
        lookup, history, tokens = PromptLookup(ngram, 8), seen([], ngram), []
        for _ in range(400):
            if tokens and rng.random() < 0.3:
                n = rng.randint(1, min(4, len(tokens)))
                assert history.trim(n) == n
                del tokens[len(tokens) - n:]
            else:
                grown = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
                history.extend(grown)
                tokens += grown
            assert history.tokens == tokens
            if tokens:  # mlx-lm looks up after at least one token
                assert lookup.predict(history) == scanned(tokens, ngram), (ngram, tokens)


def test_draft_settings_are_checked(checkpoint):
    path = checkpoint("qwen3_moe")
    for flags, message in ((["--num-draft-tokens", 0], "the value must be at least 1, not 0"),
                           (["--prompt-lookup-ngram", -1], "prompt_lookup_ngram must be from 0 (off) to 64"),
                           (["--draft-model", "/nonexistent/draft"], "the draft model: model path /nonexistent/draft does not exist")):
        proc = launch(2, ["--model", path, "-p", "x", "-m", 2, *flags])
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags,message", [
    (["--max-draft-tokens", 65], "--max-draft-tokens must be from 1 to 64, not 65"),
    (["--max-draft-tokens", 4, "--num-draft-tokens", 5], "--num-draft-tokens must be from 1 to --max-draft-tokens (4), not 5"),
])
def test_server_draft_caps_are_checked_at_start(flags, message):
    proc = launch(2, ["--port", 0, *flags], module="mlxdist.serve", timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_server_with_a_draft_model_answers_as_plain_greedy(checkpoint):
    """mlxdist.serve --draft-model (mlx-lm's server then decodes one request
    at a time, speculatively): two concurrent clients, one streamed, each
    greedy answer equal to mlx-lm's for the prompt alone; then the same
    requests again, each three times, reusing the prompt cache (a cache the
    speculative loop left one token short made the repeats other text); a
    request drafting more than --max-draft-tokens is refused, naming it."""
    import threading

    from test_serve import PROMPTS, Server, alone, completion

    path = checkpoint("qwen3_moe")
    server = Server(path, extra=["--draft-model", path, "--num-draft-tokens", 3, "--max-draft-tokens", 4])
    try:
        answers = {}

        def client(prompt, stream):
            if stream:
                status, text = server.request("POST", "/v1/completions",
                                              {"prompt": prompt, "max_tokens": 10, "stream": True})
                assert status == 200, text
                chunks = [json.loads(l[6:]) for l in text.splitlines() if l.startswith("data: {")]
                answers[prompt] = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                answers[prompt] = completion(server, prompt, max_tokens=10, num_draft_tokens=2)["choices"][0]["text"]

        threads = [threading.Thread(target=client, args=(PROMPTS[i], i == 1)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for prompt in PROMPTS[:2]:
            assert answers[prompt] == alone(path, prompt, 10), prompt
        for prompt in (PROMPTS[0], PROMPTS[3], PROMPTS[0]):  # one prefix, then the prompt seen with its answer
            for width in (3, 1, 4):
                assert completion(server, prompt, num_draft_tokens=width)["choices"][0]["text"] == alone(path, prompt, 8)
        status, body = server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "num_draft_tokens": 5})
        assert status == 400 and body["error"]["message"] == (
            "num_draft_tokens must be at most 4 (this server's --max-draft-tokens), not 5"), body
    finally:
        assert server.stop() == 0, server.proc.stderr.read()[-3000:]


def test_job_file_with_prompt_lookup_is_plain_greedy(checkpoint, plain, tmp_path):
    """A job line's prompt_lookup_ngram: the job runs alone, speculatively; its tokens are plain greedy's."""
    path = checkpoint("qwen3_moe")
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text("\n".join(json.dumps({"id": i, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **extra})
                              for i, extra in enumerate([{"prompt_lookup_ngram": 2}, {"prompt_lookup_ngram": 3,
                                                                                       "num_draft_tokens": 2}, {}]))
                    + "\n" + json.dumps({"id": "bad", "prompt": "x", "num_draft_tokens": 1.5}) + "\n")
    proc = launch(2, ["--model", path, "--jobs", jobs, "--out", out, "--ignore-chat-template"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [records[str(i)]["tokens"] for i in range(3)] == [plain] * 3
    assert records["bad"]["error"] == "line 4: num_draft_tokens must be an integer or auto, got 1.5"


def test_auto_width_follows_what_earlier_prompts_measured(checkpoint, plain):
    """--num-draft-tokens auto (the default): the first prompt drafts 3 a
    forward, the second one more or one fewer (a second width to measure),
    the rest the width with the most tokens a second by what was measured
    (verify_width.py); every answer is plain greedy."""
    path = checkpoint("qwen3_moe")
    proc = launch(2, ["--model", path, "-m", MAX_TOKENS, "--json", "--ignore-chat-template",
                      "--mode", "collective", "--prompt-lookup-ngram", 2], input=(PROMPT + "\n") * 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["tokens"] for r in records] == [plain] * 4
    widths = [r["num_draft_tokens"] for r in records]
    assert widths[0] == 3 and widths[1] in (2, 4), widths
    assert all(1 <= k <= 16 for k in widths), widths


def test_the_servers_prompt_cache_keeps_entries_cut_to_their_tokens():
    """serving/prompt_cache.py, on mlx-lm's own caches: an entry whose layers
    hold fewer tokens than its key (the speculative loop's) is kept under the
    tokens every layer holds; a request equal to a whole key gets the entry
    less its last token, which it then computes."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxdist.serving.prompt_cache import AlignedPromptCache

    def layer(tokens):
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, tokens, 4)), mx.zeros((1, 1, tokens, 4)))
        return cache

    store = AlignedPromptCache(4)
    store.insert_cache("m", [1, 2, 3, 4, 5, 6], [layer(5), layer(4)])  # the model one short, the draft two
    cache, rest = store.fetch_nearest_cache("m", [1, 2, 3, 4, 9])
    assert rest == [9] and [c.offset for c in cache] == [4, 4]
    cache, rest = store.fetch_nearest_cache("m", [1, 2, 3, 4])
    assert rest == [4] and [c.offset for c in cache] == [3, 3]
    cache, rest = store.fetch_nearest_cache("m", [1, 2, 3, 4, 5, 6])  # tokens 5 and 6 were not kept
    assert rest == [5, 6] and [c.offset for c in cache] == [4, 4]
