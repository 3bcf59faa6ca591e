"""What one client may cost the server, and start-ups that cannot serve,
under real mpirun (np = 2): a deadline for the whole request (408) however
slowly it trickles in, bounded headers (431) before the API key is read,
the connection cap shedding slow and half-open clients while a complete
request is answered, integers in ASCII digits only, client mistakes as
OpenAI-shaped 4xx, clients that leave without a traceback; a port in use,
a malformed environment variable and a bad duration each end the job with
one line."""

import json
import socket
import threading
import time

import pytest

from conftest import error_lines, launch
from test_hostile import error_shaped, raw_request
from test_serve import KEY, PROMPTS, Server, alone, free_port

REQUEST_TIMEOUT = 4
CAP = 8


@pytest.fixture(scope="module")
def limited(checkpoint):
    s = Server(checkpoint("qwen3_moe"), extra=["--request-timeout", REQUEST_TIMEOUT, "--idle-timeout", "60",
                                               "--max-connections", CAP])
    yield s
    s.stop()


def head(length=None, key=KEY, extra=b"") -> bytes:
    lines = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n" + extra
    if length is not None:
        lines += b"Content-Length: " + str(length).encode() + b"\r\n"
    return lines + b"\r\n"


def parse_reply(reply: bytes):
    """(status, the JSON body or None) of a raw HTTP reply."""
    status_line, _, rest = reply.partition(b"\r\n")
    status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else None
    body = rest.partition(b"\r\n\r\n")[2]
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def trickle(port: int, prefix: bytes, data: bytes, every: float, limit: float = 30):
    """Send ``prefix`` at once, then ``data`` one byte per ``every`` seconds
    until the server answers or closes; (the reply, seconds taken)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        s.sendall(prefix)
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
            except OSError:
                break
            s.settimeout(every)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            reply = chunk
            s.settimeout(limit)
            while chunk:
                chunk = s.recv(65536)
                reply += chunk
            return reply, time.monotonic() - start
    return b"", time.monotonic() - start


@pytest.fixture(scope="module")
def trickled(limited):
    """part -> (reply, seconds) of two requests trickled in one byte every
    0.3 s, the headers of one and the body of the other, sent side by side
    (each connection has its own deadline)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode() + b" " * 200
    sends = {"headers": (b"", head(len(body), extra=b"X-Pad: " + b"a" * 100 + b"\r\n")),
             "body": (head(len(body)), body)}
    results = {}

    def send(part):
        results[part] = trickle(limited.port, *sends[part], 0.3)

    threads = [threading.Thread(target=send, args=(part,)) for part in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_request_trickled_in_is_cut_off_at_its_deadline(trickled, part):
    """One byte every 0.3 s never trips the idle timeout (60 s); the whole
    request's deadline (4 s) answers 408 and closes (today's main answered
    such a request 200 after a minute)."""
    reply, seconds = trickled[part]
    status, answer = parse_reply(reply)
    assert status == 408 and error_shaped(status, answer), reply[:300]
    assert REQUEST_TIMEOUT - 0.5 < seconds < REQUEST_TIMEOUT + 3, seconds


def test_headers_are_bounded_before_the_key_is_read(limited):
    """32 KiB of request line and headers, 64 header lines: past either a
    431, whatever the key (today's main answered 98 headers of 65 KB)."""
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(40))  # 40 KB
    for key in (KEY, "wrong-key"):
        status, answer = parse_reply(raw_request(limited.port, head(16, key, many), b'{"prompt": "Hi"}'))
        assert status == 431 and error_shaped(status, answer), answer
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(70))
    status, answer = parse_reply(raw_request(limited.port, head(16, "wrong-key", lines), b'{"prompt": "Hi"}'))
    assert status == 431 and error_shaped(status, answer), answer
    # a flood of header bytes is cut off at the bound: the server answers and closes without reading it all
    with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer nope\r\n")
        try:
            for _ in range(100):
                s.sendall(b"X-Flood: " + b"f" * 65000 + b"\r\n")
        except OSError:  # closed by the server: the rest is never read
            pass
        status, _ = parse_reply(s.recv(65536))
    assert status in (431, None)
    assert limited.get("/health")[0] == 200


def test_slow_and_half_open_clients_at_the_cap_do_not_lock_out_a_complete_request(limited, checkpoint):
    """--max-connections 8 held by clients that sent half a request, or
    nothing: a client with a whole request takes the place of the one that
    has been sending the longest and is answered (today's main closed it
    unanswered)."""
    held = []
    try:
        for i in range(CAP):
            c = socket.create_connection(("127.0.0.1", limited.port))
            if i % 2 == 0:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half a request
            held.append(c)
        time.sleep(0.5)
        for prompt in PROMPTS[:3]:
            status, body = limited.post("/v1/completions", {"prompt": prompt, "max_tokens": 6})
            assert status == 200, body
            assert body["choices"][0]["text"] == alone(checkpoint("qwen3_moe"), prompt, 6)
        c = held[0]  # the one sending the longest, shed for the first request: told why, then closed
        c.settimeout(5)
        status, answer = parse_reply(c.recv(65536))
        assert status == 503 and answer["error"]["type"] == "server_error", answer
    finally:
        for c in held:
            c.close()


@pytest.mark.parametrize("key", ["²", "¹", "1²", "١", "٣", "𝟙", "５", " 5", "-0"])
def test_token_ids_in_other_digits_are_refused(limited, key):
    """Today's main gave no answer for the first three (a traceback on rank 0)
    and read the next four as token ids 1, 3, 1 and 5."""
    status, body = limited.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logit_bias": {key: 5}})
    assert status == 400 and error_shaped(status, body) and body["error"]["param"] == "logit_bias", body


@pytest.mark.parametrize("length", [b"\xb2", "５".encode(), "١٢".encode()])
def test_content_length_in_other_digits_is_refused(limited, length):
    head_ = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Length: " + length + b"\r\n\r\n")
    status, answer = parse_reply(raw_request(limited.port, head_, b'{"prompt": "Hi"}'))
    assert status == 400 and error_shaped(status, answer) and answer["error"]["param"] == "Content-Length", answer


IMAGE = {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                     {"type": "image_url", "image_url": {"url": None}}]}


@pytest.mark.parametrize("url", ["data:image/png;base64,iVBORw0KGgo=", "file:///etc/passwd", "http://127.0.0.1:1/x"])
def test_image_parts_on_a_text_model_are_400(limited, url):
    message = json.loads(json.dumps(IMAGE))
    message["content"][1]["image_url"]["url"] = url
    status, body = limited.post("/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert status == 400 and error_shaped(status, body) and "text only" in body["error"]["message"], body


@pytest.mark.parametrize("raw", [b'{"prompt": "a \\ud800 b", "max_tokens": 2}',
                                 b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
                                 b'{"prompt": "Hi", "stop": ["\\ud834"], "max_tokens": 2}'])
def test_a_lone_surrogate_is_400(limited, raw):
    path = "/v1/completions" if b"prompt" in raw else "/v1/chat/completions"
    status, text = limited.request("POST", path, raw)
    assert status == 400 and error_shaped(status, json.loads(text)), text


@pytest.mark.parametrize("options,usage", [({}, False), ({"include_usage": True}, True),
                                           ({"include_usage": False, "include_obfuscation": False}, False)])
def test_stream_options_end_the_stream_with_done(limited, options, usage):
    """{} passed the schema on today's main and ended the stream without
    data: [DONE] (mlx-lm reads include_usage with no default)."""
    status, text = limited.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                               "stream_options": options})
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
    assert ('"usage"' in text) == usage, text


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, {"usage": True}, [], "on"])
def test_stream_options_are_checked_field_by_field(limited, options):
    status, body = limited.post("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": options})
    assert status == 400 and body["error"]["param"] == "stream_options", body


@pytest.mark.parametrize("line,status", [(b"BREW /v1/completions HTTP/1.1", 501), (b"PUT /v1/models HTTP/1.1", 501),
                                         (b"GET /v1/models HTTP/9.9", 505), (b"HELLO", 400),
                                         (b"GET /v1/nothing HTTP/1.1", 404)])
def test_protocol_errors_are_openai_json(limited, line, status):
    """Today's main answered these with the standard library's HTML page, or
    404's plain text."""
    got, answer = parse_reply(raw_request(limited.port, line + b"\r\nAuthorization: Bearer " + KEY.encode()
                                          + b"\r\n\r\n"))
    assert got == status, (line, got, answer)
    assert isinstance(answer, dict) and {"message", "type", "param", "code"} <= set(answer["error"]), answer


def test_clients_that_leave_mid_answer(limited, checkpoint):
    """Streams and plain requests dropped mid-answer: the next answers are
    right and the end of the module checks no traceback was printed."""
    for i in range(12):
        body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "stream": bool(i % 2)}).encode()
        with socket.create_connection(("127.0.0.1", limited.port), timeout=30) as s:
            s.sendall(head(len(body)) + body)
            if i % 2:
                s.recv(200)  # the stream has started
    deadline = time.monotonic() + 60
    while True:  # the abandoned answers may still fill the connection cap: a new connection is shed meanwhile
        try:
            status, body = limited.post("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6})
            break
        except ConnectionError:  # http.client.RemoteDisconnected: closed unanswered
            assert time.monotonic() < deadline, "still shed a minute after the clients left"
            time.sleep(0.5)
    assert status == 200 and body["choices"][0]["text"] == alone(checkpoint("qwen3_moe"), PROMPTS[1], 6)


def test_the_limited_server_ends_cleanly_without_a_traceback(limited):
    time.sleep(1)
    assert limited.stop() == 0
    stderr = limited.proc.stderr.read()
    assert "Traceback" not in stderr and "Exception occurred" not in stderr, stderr[-3000:]


# -- start-ups that cannot serve: one line, every rank gone, a non-zero status ------------------------------------

def expect_one_error(proc) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = error_lines(proc.stderr, "mlxdist: error:")
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_a_port_in_use_ends_the_job(checkpoint):
    """Today's main loaded the model, printed a traceback and never exited."""
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        start = time.monotonic()
        proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--port", port], module="mlxdist.serve", timeout=90)
    assert "cannot listen on 127.0.0.1:%d" % port in expect_one_error(proc)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("module,option", [("mlxdist.run", "--timeout"), ("mlxdist.serve", "--timeout"),
                                           ("mlxdist.serve", "--request-timeout"), ("mlxdist.serve", "--idle-timeout")])
def test_durations_must_be_positive_and_finite(checkpoint, capsys, module, option):
    """Today's main: --timeout 0 ended a run blaming a hang, -5 and nan turned
    the watchdog off, serve --timeout 0 meant 120 s (and served). Each value
    through the module's main in this process (its parser alone refuses
    them), and 0 under mpirun at np 2 too."""
    import importlib

    main = importlib.import_module(module.replace("mlxdist.", "mlxdist.cli.")).main
    prompt = ["--prompt", "hi"] if module == "mlxdist.run" else []

    def args(value):
        return ["--model", str(checkpoint("qwen3_moe")), *prompt, f"{option}={value}"]

    for value in ("0", "-5", "nan", "inf", "1e999", "５"):
        with pytest.raises(SystemExit) as refused:
            main(args(value))
        stderr = capsys.readouterr().err
        assert refused.value.code == 2, (value, stderr[-2000:])
        assert "positive, finite number of seconds" in stderr and stderr.count("error:") == 1, stderr
    proc = launch(2, args("0"), module=module, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "positive, finite number of seconds" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1, proc.stderr


@pytest.mark.parametrize("name,value", [("NCCL_PORT", "abc"), ("NCCL_PORT", "５"), ("MLX_WORLD_SIZE", "-1"),
                                        ("MLXDIST_DEBUG", "maybe")])
def test_a_malformed_environment_variable_ends_the_job(checkpoint, name, value):
    """Today's main ignored these under the mpi backend or read 'maybe' as false."""
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--prompt", "hi"], env={name: value}, timeout=60)
    assert name in expect_one_error(proc)


def test_a_malformed_launcher_variable_in_one_process(checkpoint):
    """PMI_SIZE=abc printed a 20-line traceback on today's main."""
    proc = launch(0, ["--model", checkpoint("qwen3_moe"), "--prompt", "hi"], env={"PMI_SIZE": "abc"}, timeout=60)
    assert "PMI_SIZE" in expect_one_error(proc)


def test_the_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """The key need not be on the command line, where ps shows it."""
    from mlxdist.cli.serve import build_parser, check_options

    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    args = build_parser().parse_args(["--host", "0.0.0.0", "--api-key-file", str(key_file)])
    assert check_options(args) is None and args.api_key == "from-a-file"
    monkeypatch.setenv("MLXDIST_API_KEY", "from-the-environment")
    args = build_parser().parse_args(["--host", "0.0.0.0"])
    assert check_options(args) is None and args.api_key == "from-the-environment"
    key_file.write_text("\n")
    args = build_parser().parse_args(["--api-key-file", str(key_file)])
    assert "first line is empty" in check_options(args)
