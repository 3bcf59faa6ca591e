"""The OpenAI-compatible server (python -m mlxdist.serve) at np = 2 under real
mpirun: the official openai client and curl, streaming and not, errors as
HTTP statuses, the API key, a load test of concurrent clients whose greedy
answers equal the same requests sent alone, a client leaving mid-stream, and
a lost rank."""

import functools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import MPIRUN, ROOT, interruptible, mlx_lm_loaded, mpirun_env
from mlxdist.bench.recovery import launcher_rank_of

KEY = "test-key-123"
PROMPTS = [f"Request {i}: " + "tokens " * (i % 5) for i in range(8)]


SERVING = re.compile(r"mlxdist: serving .* on http://\S+:(\d+) \(")


def free_port() -> int:
    """A port free now: only for a test that holds it itself (a server is
    started with --port 0, or the job's own MPI connections may take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Prefixed:
    """A process's stderr whose first lines were read already: ``read()`` gives them too."""

    def __init__(self, seen: str, stream):
        self.seen, self.stream = seen, stream

    def read(self) -> str:
        return self.seen + self.stream.read()


def serving_port(proc: subprocess.Popen, deadline: float) -> int:
    """The port of the 'serving ... on http://HOST:PORT' line on ``proc``'s
    stderr (text mode), read up to that line; ``proc.stderr.read()`` still
    gives every line. RuntimeError where the job ends or ``deadline`` (a
    ``time.time()``) passes first."""
    lines: "queue.Queue" = queue.Queue()

    def read():
        for line in proc.stderr:
            lines.put(line)
            if SERVING.search(line):
                return
        lines.put(None)  # its end

    threading.Thread(target=read, daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            raise RuntimeError(f"server did not come up: {''.join(seen)[-4000:]}") from None
        if line is None:
            proc.wait(30)
            raise RuntimeError(f"server exited: {''.join(seen)[-4000:]}")
        seen.append(line)
        found = SERVING.search(line)
        if found:
            proc.stderr = _Prefixed("".join(seen), proc.stderr)
            return int(found.group(1))


def rank_pids_with(required, excluded=()):
    """Pids of the rank processes (the launcher's own have no rank) whose
    command line holds every argument of ``required`` and none of
    ``excluded``, in rank order."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if all(a.encode() in args for a in required) and not any(a.encode() in args for a in excluded) \
                and launcher_rank_of(int(entry)) >= 0:
            pids.append(int(entry))
    return sorted(pids, key=launcher_rank_of)


class Server:
    def __init__(self, path, nranks=2, extra=(), env=None):
        self.model = path
        self.proc = subprocess.Popen(self.command(path, nranks, extra), env={**mpirun_env(), **(env or {})},
                                     cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, preexec_fn=interruptible)
        deadline = time.time() + 120
        self.port = serving_port(self.proc, deadline)  # --port 0: the server binds a free port and says which
        self.url = f"http://127.0.0.1:{self.port}"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-4000:]}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)  # a refused connection costs nothing: ask often, to start serving sooner
        raise RuntimeError("server did not come up")

    def command(self, path, nranks, extra):
        """The launch: mpirun, ``nranks`` ranks of ``mlxdist.serve``."""
        return [MPIRUN, "-np", str(nranks), "--oversubscribe", "--bind-to", "none", "--stdin", "none",
                sys.executable, "-m", "mlxdist.serve", "--model", str(path), "--port", "0",
                "--api-key", KEY, "--max-concurrent", "16", *map(str, extra)]

    def request(self, method, path, body=None, key=KEY, timeout=120):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path, key=KEY):
        return self.request("GET", path, key=key, timeout=5)

    def post(self, path, body, key=KEY):
        status, text = self.request("POST", path, body, key)
        return status, json.loads(text) if text.startswith("{") else text

    def rss_kb(self):
        """Resident memory of every rank of this server."""
        out = subprocess.run(["ps", "-o", "rss=,args=", "-g", str(os.getpgid(self.proc.pid))],
                             capture_output=True, text=True).stdout
        return sum(int(l.split()[0]) for l in out.splitlines() if "mlxdist.serve" in l and "prterun" not in l
                   and "mpirun" not in l)

    NOT_RANKS = ("prterun", "mpirun")  # the launcher's own processes, which carry the command line too

    def ranks(self):
        """Pids of the ranks, in rank order (rank 0 serves HTTP): by the rank
        the launcher gave each (its environment), not by pid, since
        mlx.launch may start rank 1 first."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(os.getpgid(self.proc.pid))], capture_output=True,
                             text=True).stdout
        pids = [int(l.split()[0]) for l in out.splitlines()
                if "-m mlxdist.serve" in l and not any(n in l for n in self.NOT_RANKS)]
        return sorted(pids, key=lambda pid: (launcher_rank_of(pid), pid))

    def stop(self):
        """Ctrl-C to rank 0: it stops serving on every rank and the job exits."""
        if self.proc.poll() is None:
            os.kill(self.ranks()[0], signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(checkpoint("qwen3_moe"))
    yield s
    code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]


def alone(path, prompt, max_tokens):
    """mlx-lm's greedy text for a raw prompt, in this process (once per session)."""
    return _alone(str(path), prompt, max_tokens)


@functools.lru_cache(maxsize=None)
def _alone(path, prompt, max_tokens):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm_loaded(path)
    return "".join(r.text for r in stream_generate(model, tokenizer, mx.array(tokenizer.encode(prompt)),
                                                   max_tokens=max_tokens))


def completion(server, prompt, max_tokens=8, **extra):
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})
    assert status == 200, body
    return body


def clients_answer_as_alone(server, clients, each, max_tokens, expected):
    """``clients`` threads send ``each`` greedy completions at once; every
    one is answered, and with ``expected[prompt]``, the answer alone."""
    results, errors = [], []

    def client(i):
        for j in range(each):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            try:
                status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
                results.append((prompt, status, body["choices"][0]["text"] if status == 200 else body))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(results) == clients * each and all(status == 200 for _, status, _ in results), results[:3]
    wrong = [(p, text, expected[p]) for p, _, text in results if text != expected[p]]
    assert not wrong, wrong[:3]


def leave_mid_stream(server):
    """Start a long stream and close the connection after its first two events."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        body = json.dumps({"prompt": PROMPTS[5], "max_tokens": 400, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += s.recv(4096)


def test_health_and_models(server):
    status, text = server.get("/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok"
    assert health["port"] == server.port and health["ranks"] == 2  # --port 0: the port the system gave
    assert health["pid"] == server.ranks()[0]  # rank 0, whose SIGINT stops the job
    # how auto decided at load (docs/modes.md): the server's collective has nothing to decide
    decision = health["auto_decision"]
    assert decision["source"] == "fixed" and decision["strategies"] == ["collective"]
    status, text = server.get("/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == str(server.model)


def test_greedy_completion_equals_mlx_lm(server, checkpoint):
    body = completion(server, PROMPTS[3], max_tokens=12)
    assert body["choices"][0]["text"] == alone(checkpoint("qwen3_moe"), PROMPTS[3], 12)
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["finish_reason"] == "length"


def test_openai_client_chat_and_stream(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="default_model", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="default_model", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    text = client.completions.create(model="default_model", prompt=PROMPTS[1], max_tokens=5, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 5


def test_tools_refused_where_the_model_calls_none(server):
    """This checkpoint's chat template names no tool format (mlx-lm finds no
    tool parser): a request offering tools gets a 400 saying so, not an
    answer whose calls would come back as text."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=[tool], max_tokens=4)
    error = refused.value.body
    assert error["param"] == "tools" and "does not call tools" in error["message"], error
    assert client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Weather?"}], tools=[],
                                          max_tokens=2).choices[0].message.role == "assistant"


def test_logprobs(server):
    """mlx-lm's form: choices[0].logprobs.content, one {id, logprob} per token."""
    body = completion(server, PROMPTS[1], max_tokens=5, logprobs=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(c["logprob"] <= 0 for c in content)


def test_curl_streaming_and_not(server):
    base = ["curl", "-s", "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}"]
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 6})
    plain = json.loads(subprocess.run(base + ["-d", body, server.url + "/v1/completions"],
                                      capture_output=True, text=True, timeout=60).stdout)
    sse = subprocess.run(base + ["-N", "-d", json.dumps({"prompt": PROMPTS[2], "max_tokens": 6, "stream": True}),
                                 server.url + "/v1/completions"], capture_output=True, text=True, timeout=60).stdout
    events = [l[len("data: "):] for l in sse.splitlines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == plain["choices"][0]["text"]


def test_stop_words_cut_the_text(server, checkpoint):
    """A stop word (mlx-lm matches it on tokens: here the text of the 4th
    generated token) ends the completion before it."""
    from mlx_lm import load

    _, tokenizer = load(str(checkpoint("qwen3_moe")))
    body = completion(server, PROMPTS[4], max_tokens=12, logprobs=True)
    full, ids = body["choices"][0]["text"], [c["id"] for c in body["choices"][0]["logprobs"]["content"]]
    stop = tokenizer.decode(ids[3:4])
    assert tokenizer.encode(stop, add_special_tokens=False) == ids[3:4]
    cut = completion(server, PROMPTS[4], max_tokens=12, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"].strip() == tokenizer.decode(ids[:3]).strip() and full.startswith(cut["text"])


def test_seeded_sampling_repeats_and_survives_a_client_leaving(server):
    """Seeded requests run one at a time on every rank: the same seed gives
    the same text; a client leaving one mid-stream ends it on every rank at
    the same token (each token of a request served alone is a shared
    message) and the server goes on."""
    body = {"prompt": PROMPTS[7], "max_tokens": 8, "temperature": 0.9, "seed": 7}
    first = server.post("/v1/completions", body)[1]["choices"][0]["text"]
    assert server.post("/v1/completions", body)[1]["choices"][0]["text"] == first
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        data = json.dumps({**body, "max_tokens": 60, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += s.recv(4096)
    assert completion(server, PROMPTS[0])["choices"][0]["text"]


def test_errors_are_http_statuses_and_the_server_keeps_serving(server):
    assert server.post("/v1/completions", {"prompt": "x", "temperature": -1})[0] == 400
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 10**7})[0] == 400  # past the context
    assert server.post("/v1/completions", b"{not json")[0] == 400
    assert server.post("/v1/completions", {"prompt": "x"}, key="wrong")[0] == 401
    assert server.get("/health", key=None)[0] == 401
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # refused before its body is read
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {5 << 20}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.0 413")
    assert completion(server, PROMPTS[0])["choices"][0]["text"]


def test_concurrent_clients_get_what_they_would_alone(server):
    """64 clients x 4 requests at once, twice; greedy answers equal each
    request sent alone (continuous batching joins them mid-decode), none
    lost, and memory flat: the second burst leaves the ranks no bigger than
    the first did (the first grows MLX's buffer cache and the prompt cache
    to their working size)."""
    expected = {p: completion(server, p, max_tokens=6)["choices"][0]["text"] for p in PROMPTS}

    def burst():
        clients_answer_as_alone(server, 64, 4, 6, expected)
        return server.rss_kb()

    after_first = burst()
    assert burst() <= 1.2 * after_first + 64 * 1024


def test_a_client_leaving_mid_stream(server):
    """The client closes its connection after two events of a long stream:
    the sequence leaves the batch and the next request is served as usual."""
    leave_mid_stream(server)
    tic = time.time()
    body = completion(server, PROMPTS[6], max_tokens=6)
    assert body["choices"][0]["text"]
    assert time.time() - tic < 60


def test_binding_beyond_loopback_needs_a_key(checkpoint):
    proc = subprocess.run([MPIRUN, "-np", "2", "--oversubscribe", sys.executable, "-m", "mlxdist.serve", "--model",
                           str(checkpoint("qwen3_moe")), "--host", "0.0.0.0"], env=mpirun_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "mlxdist: error: binding 0.0.0.0 exposes the model beyond this machine: give --api-key" in proc.stderr


def test_a_lost_rank_ends_the_server(checkpoint):
    """kill -9 of rank 1 while two requests decode: the plain one gets HTTP
    503 with an OpenAI-style error, the streaming one (already 200) an error
    event, new requests 503; the job exits non-zero within seconds."""
    s = Server(checkpoint("qwen3_moe"))
    try:
        ranks = s.ranks()
        assert len(ranks) == 2
        victim = ranks[1]
        got = {}

        def ask(stream):
            body = {"prompt": PROMPTS[0], "max_tokens": 4000, "stream": stream}
            try:
                got[stream] = s.request("POST", "/v1/completions", body)
            except OSError as e:
                got[stream] = (None, repr(e))

        threads = [threading.Thread(target=ask, args=(stream,), daemon=True) for stream in (False, True)]
        for t in threads:
            t.start()
        time.sleep(3)
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(30)
        s.proc.wait(60)
        assert s.proc.returncode != 0
        status, text = got[False]
        assert status == 503, got
        assert json.loads(text)["error"]["code"] == 503
        status, text = got[True]
        assert status == 200 and "data: {" in text, got
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == 503, events[-1]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def dp_server(checkpoint):
    s = Server(checkpoint("qwen3_moe"), extra=["--mode", "dp"])
    yield s
    code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]


def test_dp_server_clients_get_what_they_would_alone(dp_server, checkpoint):
    """--mode dp (each rank decodes a share of the live sequences): 16
    concurrent clients x 2 requests, joining mid-decode; each greedy answer
    (float32) equals mlx-lm's for the prompt alone, streamed ones too."""
    path = checkpoint("qwen3_moe")
    expected = {p: alone(path, p, 8) for p in PROMPTS}
    clients_answer_as_alone(dp_server, 16, 2, 8, expected)
    status, text = dp_server.request("POST", "/v1/completions",
                                     {"prompt": PROMPTS[1], "max_tokens": 8, "stream": True})
    assert status == 200
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in text.splitlines()
                       if line.startswith("data: {"))
    assert streamed == expected[PROMPTS[1]]


def test_dp_server_leaving_clients_and_refusals(dp_server):
    """A client leaving mid-stream leaves its rank's batch and the server
    goes on; logprobs are there, top_logprobs (not gathered in dp) a 400; a seeded request
    (served alone, by the exact strategy) repeats."""
    leave_mid_stream(dp_server)
    assert completion(dp_server, PROMPTS[6], max_tokens=6)["choices"][0]["text"]
    body = completion(dp_server, PROMPTS[1], max_tokens=5, logprobs=True)  # the sampled tokens' are gathered
    assert len(body["choices"][0]["logprobs"]["content"]) == 5
    status, body = dp_server.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "logprobs": True,
                                                      "top_logprobs": 3})
    assert status == 400 and "top_logprobs is not available with --mode dp" in json.dumps(body), body
    seeded = [completion(dp_server, PROMPTS[2], max_tokens=6, temperature=1.0, seed=7)["choices"][0]["text"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_dp_server_copies_of_one_request_are_independent_samples(dp_server):
    """n identical requests at temperature 1, sent at once, spread over the
    ranks: each draws from keys of its own (engine/sampling.py), so the n
    answers differ (before, rank r's row i drew rank s's row i's noise and
    copies that joined together came back in identical pairs)."""
    texts, errors = [], []

    def client():
        try:
            texts.append(completion(dp_server, PROMPTS[3], max_tokens=12, temperature=1.0)["choices"][0]["text"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(set(texts)) == len(texts) == 16, texts


def test_dp_server_with_experts_cut_in_width(checkpoint):
    """--mode dp --expert-split width (whole MoE blocks exchanged, not
    bit-exact): 8 concurrent clients joining and leaving; each greedy answer
    (float32, 8 tokens) equals mlx-lm's for the prompt alone, and the server
    shuts down cleanly."""
    path = checkpoint("qwen3_moe")
    s = Server(path, extra=["--mode", "dp", "--expert-split", "width"])
    try:
        expected = {p: alone(path, p, 8) for p in PROMPTS}
        clients_answer_as_alone(s, 8, 2, 8, expected)
    finally:
        code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]
