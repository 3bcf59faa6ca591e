"""The front (python -m mlxdist.serve --ranks 2): one process holding the
port, FastAPI on uvicorn, starting the rank job itself under real mpirun and
forwarding to it. One front for the module: 503 with Retry-After before the
job serves, greedy answers equal to mlx-lm's, streams passed through, the
official openai client, the API key, Host and Content-Type checks, CORS,
hostile bodies, a request trickled in (408), the connection cap, a reader
that does not read (cut), /metrics, /health, and last a rank killed
mid-stream (the stream ends with an error; 503 while the job recovers)."""

import json
import os
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

from conftest import ROOT, mlx_lm_loaded, mpirun_env
from test_hostile import HOSTILE_BODIES, HOSTILE_RAW, error_shaped, raw_request
from test_limits import parse_reply, trickle
from test_serve import KEY, PROMPTS, alone, rank_pids_with

FRONT_LINE = re.compile(r"mlxdist: front on http://127\.0\.0\.1:(\d+) ")
CAP = 8
REQUEST_TIMEOUT = 4
WRITE_TIMEOUT = 3
ORIGIN = "http://ok.example"
EOS = 2  # the synthetic tokenizer's <|im_end|>: kept from ending the long streams


class Front:
    """``python -m mlxdist.serve --ranks 2`` (or ``ranks``) on ``path``, its stderr collected."""

    def __init__(self, path, extra=(), ranks=2, env=None):
        self.model = path
        cmd = [sys.executable, "-m", "mlxdist.serve", "--ranks", str(ranks), "--model", str(path), "--port", "0",
               "--api-key", KEY, "--max-concurrent", "16", *map(str, extra)]
        self.proc = subprocess.Popen(cmd, env={**mpirun_env(), **(env or {})}, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines = []
        self._port_seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port_seen.wait(60):
            self.kill()
            raise RuntimeError("the front said no port:\n" + self.stderr())
        self.port = int(FRONT_LINE.search(self.stderr()).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if FRONT_LINE.search(line):
                self._port_seen.set()

    def stderr(self) -> str:
        return "".join(self.lines)

    def request(self, method, path, body=None, key=KEY, headers=None, timeout=120):
        """(status, headers, text) of one request."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.headers, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode()

    def post(self, path, body, **kw):
        status, headers, text = self.request("POST", path, body, **kw)
        return status, headers, json.loads(text) if text.startswith("{") else text

    def health(self):
        status, headers, text = self.request("GET", "/health", timeout=10)
        return status, headers, json.loads(text)

    def wait_for(self, states, timeout=240):
        """/health once its status is one of ``states``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.stderr()[-4000:]
            try:
                got = self.health()
                if got[2]["status"] in states:
                    return got
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"/health never said {states}:\n{self.stderr()[-4000:]}")

    def metrics(self):
        from prometheus_client.parser import text_string_to_metric_families

        status, _, text = self.request("GET", "/metrics")
        assert status == 200, text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def rank_pids(self):
        """Pids of the job's ranks, in rank order (their command lines name
        this front's checkpoint; the launcher's own processes have no rank)."""
        return rank_pids_with(["mlxdist.serve", str(self.model)], excluded=["--ranks"])

    def stop(self) -> int:
        """Ctrl-C: the front stops its job, then itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self):
        from conftest import kill_session

        for pid in self.rank_pids():
            kill_session(os.getsid(pid))
        kill_session(self.proc.pid)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def front(checkpoint):
    """The front, and what it answered before its job served (the job takes
    seconds to start its ranks: the first answers cannot come from it)."""
    f = Front(checkpoint("qwen3_moe"), ["--request-timeout", REQUEST_TIMEOUT, "--idle-timeout", "60",
                                        "--max-connections", CAP, "--write-timeout", WRITE_TIMEOUT,
                                        "--allow-origin", ORIGIN])
    try:
        f.before = {"chat": f.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                    "health": f.health()}
        f.wait_for(("ok",))
    except BaseException:
        f.kill()
        raise
    yield f
    if f.proc.poll() is None:
        f.kill()


def test_503_with_retry_after_before_the_job_serves(front):
    status, headers, body = front.before["chat"]
    assert status == 503 and headers["Retry-After"] == "5", (status, body)
    assert body["error"]["type"] == "server_error" and "loading" in body["error"]["message"], body
    status, headers, health = front.before["health"]
    assert status == 503 and health["status"] == "starting" and headers["Retry-After"], health


def test_health_once_serving(front):
    status, _, health = front.health()
    assert status == 200 and health["status"] == "ok", health
    assert health["ranks"] == 2 and health["hosts"] == ["localhost", "localhost"]
    assert health["port"] == front.port and health["last_recovery"] is None


def test_greedy_answers_equal_mlx_lm(front, checkpoint):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    path = checkpoint("qwen3_moe")
    status, _, body = front.post("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 12})
    assert status == 200 and body["choices"][0]["text"] == alone(path, PROMPTS[3], 12), body
    model, tokenizer = mlx_lm_loaded(str(path))
    messages = [{"role": "user", "content": "Say something"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = "".join(r.text for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=10))
    status, _, body = front.post("/v1/chat/completions", {"messages": messages, "max_tokens": 10})
    assert status == 200 and body["choices"][0]["message"]["content"] == expected, body
    assert body["usage"]["completion_tokens"] == 10 and body["usage"]["prompt_tokens"] == len(prompt)


def test_streams_pass_through(front, checkpoint):
    """Line by line as the rank server sends them, ending with [DONE]; the
    usage the front asked for to count tokens is not passed on unasked."""
    status, headers, text = front.request("POST", "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 12,
                                                                       "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == alone(checkpoint("qwen3_moe"), PROMPTS[3], 12)
    assert events[-1]["choices"][0]["finish_reason"] == "length" and text.rstrip().endswith("data: [DONE]")
    assert not any("usage" in e for e in events), text
    _, _, text = front.request("POST", "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 3, "stream": True,
                                                           "stream_options": {"include_usage": True}})
    usage = [json.loads(line[6:])["usage"] for line in text.splitlines() if '"usage"' in line]
    assert usage and usage[0]["completion_tokens"] == 3, text


def test_the_openai_client(front):
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=front.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert client.models.list().data[0].id == str(front.model)
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=front.url + "/v1", api_key="wrong").models.list()


def test_bodies_that_are_not_json_are_refused(front):
    """A cross-site form or fetch posts text/plain (no preflight): refused
    before anything runs, as are bodies that do not parse."""
    before = front.metrics()['mlxdist_prompt_tokens_total{}']
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        status, answer = parse_reply(raw_request(front.port, head, body))
        assert status == 415 and error_shaped(status, answer), (kind, answer)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    status, answer = parse_reply(raw_request(front.port, head, body))
    assert status == 415 and error_shaped(status, answer), answer
    assert front.metrics()['mlxdist_prompt_tokens_total{}'] == before  # nothing ran


def test_hostile_bodies_are_openai_shaped_4xx(front):
    """test_hostile's bodies through the front: each refused by the front or
    the rank server behind it, in OpenAI's shape; the job keeps serving."""
    for body in [*HOSTILE_BODIES, *HOSTILE_RAW]:
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        status, _, answer = front.post(path, body)
        assert error_shaped(status, answer), (body if isinstance(body, dict) else body[:60], status, answer)
    status, answer = parse_reply(raw_request(front.port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                             b"Connection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer " + KEY.encode()
                                             + b"\r\nContent-Length: 99999999\r\n\r\n"))
    assert status == 413 and error_shaped(status, answer), answer
    assert front.health()[0] == 200


def test_headers_are_bounded_and_protocol_errors_are_openai_json(front):
    """As the rank server (test_limits): 32 KiB of headers or 64 lines at
    most, whatever the key (431); what is no HTTP request a 400, an unknown
    method or path a 405 or 404, each OpenAI-shaped."""
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(40))
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(70))
    for extra in (many, lines):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nope\r\n" + extra
        status, answer = parse_reply(raw_request(front.port, head + b"Content-Length: 2\r\n\r\n", b"{}"))
        assert status == 431 and error_shaped(status, answer), answer
    for line, expected in ((b"HELLO", 400), (b"GET /v1/models HTTP/1.1 x", 400), (b"BREW /v1/completions HTTP/1.1", 405),
                           (b"GET /v1/nothing HTTP/1.1", 404)):
        status, answer = parse_reply(raw_request(front.port, line + b"\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer "
                                                 + KEY.encode() + b"\r\n\r\n"))
        assert status == expected and error_shaped(status, answer), (line, status, answer)
    assert front.health()[0] == 200


def test_host_must_name_the_front(front):
    """DNS rebinding: a page of evil.example whose name now points at
    127.0.0.1 sends Host: evil.example; the front does not answer it."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for host in (b"evil.example", b"evil.example:%d" % front.port, b"127.0.0.1.evil.example", b"localhost.evil"):
        head = (b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\nHost: " + host + b"\r\nAuthorization: Bearer " + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        status, answer = parse_reply(raw_request(front.port, head, body))
        assert status == 421 and error_shaped(status, answer), (host, answer)
    for host in (b"localhost:%d" % front.port, b"127.0.0.1", b"LOCALHOST"):
        head = b"GET /health HTTP/1.1\r\nConnection: close\r\nHost: " + host + b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
        assert parse_reply(raw_request(front.port, head))[0] == 200, host


def test_cors_as_the_rank_server_answers_it(front):
    status, headers, _ = front.request("OPTIONS", "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    status, headers, _ = front.request("GET", "/v1/models", headers={"Origin": "http://other.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = front.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert headers["Access-Control-Allow-Origin"] == ORIGIN


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_request_trickled_in_is_cut_off_at_its_deadline(front, part):
    """One byte every 0.3 s, of the headers or of the body: 408 at --request-timeout."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode() + b" " * 200
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n" % len(body)
            + b"X-Pad: " + b"a" * 60 + b"\r\n\r\n")
    prefix, trickled = (b"", head + body) if part == "headers" else (head, body)
    reply, seconds = trickle(front.port, prefix, trickled, 0.3)
    status, answer = parse_reply(reply)
    assert status == 408 and error_shaped(status, answer), reply[:300]
    assert REQUEST_TIMEOUT - 0.5 < seconds < REQUEST_TIMEOUT + 3, seconds


def test_a_whole_request_waits_past_the_deadline_for_its_answer():
    """--request-timeout bounds the sending of a request, not its answer: a
    whole request whose answer takes longer is answered, whether the client
    keeps its connection or says ``Connection: close`` (as urllib does); the
    next request on a kept connection has a deadline of its own. uvicorn
    with the front's protocol, on an app that answers after 2.5 deadlines."""
    import asyncio

    import uvicorn

    from mlxdist.front.limits import front_protocol
    from mlxdist.front.settings import FrontSettings

    deadline = 1.5
    settings = FrontSettings(host="127.0.0.1", port=0, api_key=None, allowed_hosts=("*",), allow_origins=(),
                             max_connections=CAP, max_body=1 << 20, max_header_bytes=8192, max_headers=64,
                             request_timeout=deadline, idle_timeout=60, write_timeout=10, retry_after=5,
                             ranks=1, hostfile=None, launcher="mpirun")

    async def slow(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await asyncio.sleep(deadline * 2.5)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(slow, http=front_protocol(settings), lifespan="off", log_level="error"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[listener]),), daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        while not server.started:
            assert thread.is_alive() and time.monotonic() - started < 30, "uvicorn did not start"
            time.sleep(0.05)
        port = listener.getsockname()[1]
        for connection in (b"close", b"keep-alive"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: " + connection +
                          b"\r\nContent-Length: 2\r\n\r\n{}")
                reply = b""
                while not reply.endswith(b"ok"):
                    chunk = c.recv(4096)
                    assert chunk, (connection, reply)
                    reply += chunk
                assert reply.startswith(b"HTTP/1.1 200"), (connection, reply)
                if connection == b"keep-alive":
                    c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # and no more: its own deadline
                    status, answer = parse_reply(c.recv(4096))
                    assert status == 408 and error_shaped(status, answer), answer
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def test_slow_and_half_open_clients_at_the_cap_do_not_lock_out_a_complete_request(front, checkpoint):
    held = []
    try:
        for i in range(CAP):
            c = socket.create_connection(("127.0.0.1", front.port))
            if i % 2 == 0:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(c)
        time.sleep(0.5)
        for prompt in PROMPTS[:3]:
            status, _, body = front.post("/v1/completions", {"prompt": prompt, "max_tokens": 6})
            assert status == 200 and body["choices"][0]["text"] == alone(checkpoint("qwen3_moe"), prompt, 6), body
        c = held[0]  # sending the longest: shed for the first request, told why
        c.settimeout(5)
        status, answer = parse_reply(c.recv(65536))
        assert status == 503 and answer["error"]["type"] == "server_error", answer
    finally:
        for c in held:
            c.close()


def _running(front) -> float:
    return front.metrics()["mlxdist_requests_running{}"]


def test_a_reader_that_does_not_read_is_cut(front):
    """A stream of 3,000 tokens whose client reads nothing: once the answer
    has waited --write-timeout on it, the connection is cut (the job stops
    generating it); the client gets no [DONE]."""
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 3000, "stream": True,
                       "logit_bias": {str(EOS): -100}}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", front.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 60
        while _running(front) < 1:
            assert time.time() < deadline, "the stream never started"
            time.sleep(0.5)
        started = time.time()
        while _running(front) > 0:
            assert time.time() < started + 300, "a reader that reads nothing held its stream for 300 s"
            time.sleep(1)
        s.settimeout(10)
        got = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass
        assert got.startswith(b"HTTP/1.1 200") and b"data: " in got and b"[DONE]" not in got, got[-300:]
        assert got.count(b"data: ") < 3000
    finally:
        s.close()
    status, _, body = front.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, body


def test_metrics_parse(front):
    m = front.metrics()
    assert m['mlxdist_requests_total{"path": "/v1/completions", "status": "200"}'] >= 3
    assert m['mlxdist_requests_total{"path": "/v1/completions", "status": "415"}'] >= 3
    assert m["mlxdist_completion_tokens_total{}"] >= 12 + 10 + 12 and m["mlxdist_prompt_tokens_total{}"] > 0
    assert m["mlxdist_time_to_first_token_seconds_count{}"] >= 2
    assert m["mlxdist_ranks_alive{}"] == 2 and m["mlxdist_serving{}"] == 1 and m["mlxdist_recoveries_total{}"] == 0
    assert m["mlxdist_requests_queued{}"] == 0 and m["mlxdist_requests_running{}"] == 0
    assert m["mlxdist_time_per_output_token_seconds_count{}"] >= 10
    assert m["mlxdist_requests_held{}"] == 0 and m["mlxdist_requests_replayed_total{}"] == 0
    sent, received = (m[f'mlxdist_rank0_exchange_bytes_total{{"direction": "{d}"}}'] for d in ("sent", "received"))
    assert sent > 0 and received > 0, m
    # rank 0's batch steps: as many as the tokens answered at least, each timed
    steps = m["mlxdist_step_seconds_count{}"]
    assert steps >= 12 and 0 < m["mlxdist_step_seconds_sum{}"] < 600, m
    bounds = sorted((float(k.split('"le": "')[1].split('"')[0]), v) for k, v in m.items()
                    if k.startswith("mlxdist_step_seconds_bucket") and "+Inf" not in k)
    assert bounds and all(a[1] <= b[1] for a, b in zip(bounds, bounds[1:])) and bounds[-1][1] <= steps, bounds
    # every rank's link (both on loopback here), from rank 1's heartbeat and rank 0's own counters
    host = socket.gethostname()
    for rank in (0, 1):
        for direction in ("sent", "received"):
            key = f'mlxdist_link_bytes_total{{"direction": "{direction}", "host": "{host}", "interface": "lo", ' \
                  f'"rank": "{rank}"}}'
            assert m.get(key, 0) > 0, (key, sorted(k for k in m if "link" in k))


def test_a_rank_lost_mid_stream(front):
    """kill -9 of rank 1 while a stream is under way: the stream ends with a
    chunk whose finish_reason is "error" and an error event (never [DONE]);
    requests get 503 with Retry-After while the job recovers; then the front
    serves again on the rank left (degraded)."""
    body = json.dumps({"prompt": PROMPTS[4], "max_tokens": 3000, "stream": True,
                       "logit_bias": {str(EOS): -100}}).encode()
    with socket.create_connection(("127.0.0.1", front.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(65536)
            assert chunk, got[-2000:]  # closed before its third chunk: never spin on it
            got += chunk
        ranks = front.rank_pids()
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    events = [json.loads(line[6:]) for line in got.decode().splitlines() if line.startswith("data: {")]
    assert b"[DONE]" not in got
    assert events[-1].get("error") is not None and events[-1]["error"]["type"] == "server_error", events[-2:]
    assert events[-2]["choices"][0]["finish_reason"] == "error", events[-2:]
    status, headers, health = front.wait_for(("recovering", "starting"), timeout=30)
    assert status == 503 and headers["Retry-After"], health
    status, headers, answer = front.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and headers["Retry-After"] and answer["error"]["type"] == "server_error", answer
    status, _, health = front.wait_for(("degraded",), timeout=240)
    assert status == 200 and health["ranks"] == 1 and health["last_recovery"]["lost_rank"] == 1, health
    status, _, body = front.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200, body
    assert front.metrics()["mlxdist_recoveries_total{}"] == 1


def test_the_front_stops_cleanly(front):
    assert front.stop() == 0, front.stderr()[-3000:]
    assert "Traceback" not in front.stderr(), front.stderr()[-3000:]
    assert not front.rank_pids()


def test_hostile_front_options_are_one_line(checkpoint, capfd, monkeypatch):
    """Before any job starts: one line, status 2 (in this process: the front's own main)."""
    from mlxdist.front.serve import main

    monkeypatch.delenv("MLXDIST_API_KEY", raising=False)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [(["--allowed-hosts", ""], "--allowed-hosts"), (["--allowed-hosts", "a, ,b"], "--allowed-hosts"),
             (["--write-timeout", "0"], "positive"), (["--retry-after", "0"], "at least 1"),
             (["--retry-after", "99999"], "--retry-after"), (["--ranks", "0"], "at least 1"),
             (["--ranks", "x"], "--ranks"), (["--launcher", "ssh"], "--launcher"),
             (["--port", str(busy.getsockname()[1])], "cannot listen"), (["--host", "0.0.0.0"], "--api-key"),
             (["--min-ranks", "3"], "--min-ranks"), (["--max-connections", "0"], "--max-connections"),
             (["--recovery-hold", "-1"], "--recovery-hold"), (["--recovery-hold", "nan"], "--recovery-hold"),
             (["--recovery-hold", "1e999"], "--recovery-hold"), (["--recovery-hold", "x" * 10_000], "--recovery-hold"),
             (["--recovery-hold-max", "-1"], "--recovery-hold-max"),
             (["--recovery-hold-max", "10000000"], "--recovery-hold-max")]
    try:
        for extra, said in cases:
            try:
                code = main(["--ranks", "2", "--model", str(checkpoint("qwen3_moe")), "--port", "0", *extra])
            except SystemExit as e:  # argparse's own line
                code = e.code
            err = capfd.readouterr().err
            assert code == 2 and "Traceback" not in err, (extra, err)
            assert said in err and len([l for l in err.splitlines() if "error" in l]) == 1, (extra, err)
    finally:
        busy.close()


def test_a_request_is_held_only_while_it_said_nothing():
    """What a stream must have sent before a lost job ends it instead of
    sending it again (front/upstream.py's _says): a content chunk, a finish,
    usage, [DONE], another error; not a keep-alive comment, a blank line or a
    chunk holding a role alone (kept back until content comes); a 503 error
    event is the lost rank's (None: held). A request that does not stream
    (``_said_nothing``) is held through a loss at any point of its answer."""
    from mlxdist.front.upstream import _said_nothing, _says

    def data(chunk):
        return "data: " + json.dumps(chunk)

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    said = [data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}),
            data({"choices": [{"index": 0, "text": "4", "finish_reason": None}]}),
            data({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}),
            data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}),
            data({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "x"}]}, "finish_reason": None}]}),
            data({"error": {"message": "failed", "code": 500}}), "data: [DONE]"]
    assert [_says(line) for line in said] == [True] * len(said)
    assert [_says(line) for line in ("", ": keepalive 4/5", data(role),
                                     data({"choices": [{"index": 0, "text": "", "finish_reason": None}]}))] == [False] * 4
    lost = data({"error": {"message": "the server lost a rank and is shutting down", "code": 503}})
    assert _says(lost) is None
    # a request that does not stream is answered at its end: until then no line says anything but a loss
    token = data({"token": 7, "logprob": -0.5, "finish_reason": None, "prompt_tokens": 3, "cached_tokens": 0})
    assert [_said_nothing(line) for line in (*said, token)] == [False] * (len(said) + 1)
    assert _says(token) is True and _said_nothing(lost) is None


def test_a_request_that_came_while_serving_is_held_through_a_loss_before_it_was_sent():
    """A request that came while the job served (its address then: ``arrived``)
    and finds it recovering when it is sent (a loss noticed while the front
    tokenised it) is held and sent to the next job once it serves, not
    answered 503; one that came while the job recovered is answered 503 at
    once. Upstream over two HTTP servers, the job's first address and the
    next one's. Before, the first was answered 503 as well (1 run in 3 of
    front_link.py beside four busy processes)."""
    import asyncio
    import types
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mlxdist.front.errors import Unavailable
    from mlxdist.front.upstream import Upstream

    def server(name):
        class Answer(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                body = json.dumps({"from": name}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        s = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        return s, f"http://127.0.0.1:{s.server_address[1]}"

    (first, first_url), (second, second_url) = server("first"), server("second")
    job = types.SimpleNamespace(base_url=None, state="recovering")  # the first job lost a rank
    upstream = Upstream(job, retry_after=7, hold=30)

    async def send(arrived):
        async with upstream.stream("/mlxdist/tokens", {"x": 1}, whole=True, arrived=arrived) as answer:
            return json.loads(await answer.aread())

    async def scene():
        came_meanwhile = None
        try:
            await send(None)
        except Unavailable as e:
            came_meanwhile = e
        held = asyncio.ensure_future(send(first_url))
        await asyncio.sleep(0.5)
        assert not held.done() and upstream.held == 1
        job.base_url, job.state = second_url, "degraded"  # the job on the ranks left serves
        try:
            return came_meanwhile, await asyncio.wait_for(held, 10)
        finally:
            await upstream.aclose()

    try:
        came_meanwhile, answer = asyncio.run(scene())
    finally:
        first.shutdown()
        second.shutdown()
    assert isinstance(came_meanwhile, Unavailable) and "starting again" in str(came_meanwhile)
    assert answer == {"from": "second"} and upstream.replayed == 1 and upstream.held == 0
