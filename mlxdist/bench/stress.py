"""``python -m mlxdist.bench stress``: many requests of mixed kinds against
one server, checked one by one, in one bounded run.

The kinds (weights out of 100, shuffled with ``--seed``):

    normal     a greedy completion: 200 and the text mlx-lm alone gives
    stream     the same, streamed: the same text, then ``data: [DONE]``
    dropped    a stream the client leaves after its first chunk
    malformed  a hostile body or protocol error: an OpenAI-shaped error (4xx; 501 for an unknown method)
    slow       a request sent in pieces: within the deadline, answered as normal; its last bytes 1.5 s past
               the deadline: 408 (or, where the server accepted the connection late, the right answer: counted)
    oversized  a body past --max-body-bytes (413) or headers past their bound (431)

Checked: every answer as above, every rank alive throughout, each rank's
resident memory (sampled every 0.5 s) within ``--rss-bound-mb`` of its
size once serving, no traceback in the server's output, and at the end a
normal answer, ``/health`` and a clean stop (status 0). The report (JSON)
gives requests/s and each rank's peak RSS; the exit status is 1 if any
check failed.

    python -m mlxdist.bench stress --model DIR --ranks 2 --requests 10000 [--out stress.json]
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mlxdist.bench.serve import Launched
from mlxdist.cli.relaunch import find_mpirun
from mlxdist.inputs.digits import arg_int, arg_number
from mlxdist.runtime.backends import free_port

KINDS = {"normal": 30, "stream": 15, "dropped": 10, "malformed": 25, "slow": 8, "oversized": 12}
PROMPTS = [f"Request {i}: " + "tokens " * (i % 5) for i in range(8)]
REQUEST_TIMEOUT = 2.0  # the server's --request-timeout here: a late slow request costs a client this long
MAX_BODY = 64 << 10
MALFORMED = [
    b'{"prompt": "Hi", "logit_bias": {"\xc2\xb2": 1}}', b'{"prompt": "Hi", "logit_bias": {"\xd9\xa1": 1}}',
    b'{"prompt": "a \\ud800 b"}', b'{"prompt": "Hi", "stream": true, "stream_options": {"x": 1}}',
    b'{"prompt": "Hi", "max_tokens": 0}', b'{"prompt": "Hi", "n": 3}', b'{"prompt": "Hi", "temperature": NaN}',
    b'{"prompt": "Hi", "logit_bias": {"1000000000": 100}}', b'{"prompt": "Hi", "top_p": 2}', b"{not json",
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}',
    b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", b'{"prompt": "Hi", "unknown": 1}', b"\xff\xfe",
]
PROTOCOL = [b"BREW /v1/completions HTTP/1.1\r\n\r\n", b"HELLO\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer %s\r\nContent-Length: \xd9\xa1\r\n\r\n"]


class Client:
    """Raw HTTP/1.1 requests to the server, each on its own connection."""

    def __init__(self, port: int, key: str, max_tokens: int, expected: Dict[str, str]):
        self.port, self.key, self.max_tokens, self.expected = port, key, max_tokens, expected
        self.late_answered: List[int] = []  # late slow requests answered (right) rather than 408

    def head(self, length: int, extra: bytes = b"") -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                + self.key.encode() + b"\r\n" + extra + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")

    def exchange(self, parts: List[bytes], pause: float = 0.0, drop_after: int = 0) -> bytes:
        """Send ``parts`` (``pause`` s apart) and read the reply to its end (or
        its first ``drop_after`` bytes, then leave)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=120) as s:
            try:
                for i, part in enumerate(parts):
                    if i and pause:
                        time.sleep(pause)
                    s.sendall(part)
            except OSError:  # the server answered and closed before all was sent (a bound, a deadline)
                pass
            reply = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except OSError:
                    return reply
                if not chunk:
                    return reply
                reply += chunk
                if drop_after and len(reply) >= drop_after:
                    return reply

    def health(self) -> bytes:
        return self.exchange([b"GET /health HTTP/1.1\r\nAuthorization: Bearer " + self.key.encode() + b"\r\n\r\n"])

    def completion(self, prompt: str, stream: bool) -> bytes:
        body = json.dumps({"prompt": prompt, "max_tokens": self.max_tokens, "stream": stream}).encode()
        return self.head(len(body)) + body

    # -- the kinds: each returns None when right, else what was wrong ------------------------------------------
    def normal(self, rng: random.Random) -> Optional[str]:
        prompt = rng.choice(PROMPTS)
        return self._check_text(self.exchange([self.completion(prompt, False)]), prompt, False)

    def stream(self, rng: random.Random) -> Optional[str]:
        prompt = rng.choice(PROMPTS)
        return self._check_text(self.exchange([self.completion(prompt, True)]), prompt, True)

    def dropped(self, rng: random.Random) -> Optional[str]:
        reply = self.exchange([self.completion(rng.choice(PROMPTS), True)], drop_after=1)
        return None if reply.startswith(b"HTTP/1.") else f"no answer begun: {reply[:80]!r}"

    def malformed(self, rng: random.Random) -> Optional[str]:
        if rng.random() < 0.2:
            raw = rng.choice(PROTOCOL).replace(b"%s", self.key.encode())
            return _check_error(self.exchange([raw]), (400, 501))
        body = rng.choice(MALFORMED)
        return _check_error(self.exchange([self.head(len(body)) + body]), (400,))

    def slow(self, rng: random.Random) -> Optional[str]:
        prompt = rng.choice(PROMPTS)
        request = self.completion(prompt, False)
        if rng.random() < 0.5:  # in time: four pieces over ~0.3 s
            step = len(request) // 4 + 1
            parts = [request[i:i + step] for i in range(0, len(request), step)]
            return self._check_text(self.exchange(parts, pause=0.1), prompt, False)
        cut = len(request) - 5  # the last bytes after the deadline
        reply = self.exchange([request[:cut], request[cut:]], pause=REQUEST_TIMEOUT + 1.5)
        if _split(reply)[0] == 200:  # the deadline runs from the server's accept, which a busy server may take late
            self.late_answered.append(1)
            return self._check_text(reply, prompt, False)
        return _check_error(reply, (408,))

    def oversized(self, rng: random.Random) -> Optional[str]:
        if rng.random() < 0.5:
            body = b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}'
            return _check_error(self.exchange([self.head(len(body)) + body[:4096]]), (413,))
        flood = b"".join(b"X-Flood-%d: %s\r\n" % (i, b"f" * 4000) for i in range(12))
        return _check_error(self.exchange([self.head(2, flood) + b"{}"]), (431,))

    def _check_text(self, reply: bytes, prompt: str, stream: bool) -> Optional[str]:
        status, body = _split(reply)
        if status != 200:
            return f"status {status}: {body[:200]!r}"
        if stream:
            events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
            if not events or events[-1].strip() != b"[DONE]":
                return f"stream without [DONE]: {body[-200:]!r}"
            text = "".join(c["choices"][0].get("text") or "" for c in map(json.loads, events[:-1]) if c.get("choices"))
        else:
            text = json.loads(body)["choices"][0]["text"]
        return None if text == self.expected[prompt] else f"wrong answer {text!r} for {prompt!r}"


def _split(reply: bytes) -> Tuple[Optional[int], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return None, reply


def _check_error(reply: bytes, statuses: Tuple[int, ...]) -> Optional[str]:
    status, body = _split(reply)
    try:
        error = json.loads(body)["error"]
        shaped = {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if status not in statuses or not shaped:
        return f"expected {statuses}, got {status}: {body[:200]!r}"
    return None


def reference_texts(model: str, max_tokens: int) -> Dict[str, str]:
    """Each prompt's greedy text from mlx-lm alone, in this process."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    lm, tokenizer = load(model)
    return {p: "".join(r.text for r in stream_generate(lm, tokenizer, mx.array(tokenizer.encode(p)),
                                                       max_tokens=max_tokens)) for p in PROMPTS}


def rank_pids(session: int) -> List[int]:
    """The ranks of the server started in ``session``, in rank order."""
    ranks = []
    for entry in os.listdir("/proc"):
        if not entry.isdecimal():
            continue
        try:
            if os.getsid(int(entry)) != session:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mlxdist.serve" not in f.read() or _is_launcher(entry):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        ranks.append((int(env.get(b"OMPI_COMM_WORLD_RANK", b"0")), int(entry)))
    return [pid for _, pid in sorted(ranks)]


def _is_launcher(pid: str) -> bool:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip() in ("prterun", "mpirun", "prted")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler(threading.Thread):
    """Each rank's RSS every 0.5 s, and whether every rank is alive."""

    def __init__(self, pids: List[int]):
        super().__init__(daemon=True)
        self.pids = pids
        self.start_mb = [rss_mb(p) for p in pids]
        self.peak_mb = list(self.start_mb)
        self.lost: List[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for i, pid in enumerate(self.pids):
                try:
                    self.peak_mb[i] = max(self.peak_mb[i], rss_mb(pid))
                except OSError:
                    if i not in self.lost:
                        self.lost.append(i)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    expected = reference_texts(args.model, args.max_tokens)
    port, key = free_port(), "stress-key"
    cmd = [args.mpirun or find_mpirun(), "-np", str(args.ranks), "--oversubscribe", "--bind-to", "none", "--stdin", "none",
           sys.executable, "-m", "mlxdist.serve", "--model", args.model, "--port", str(port), "--api-key", key,
           "--max-concurrent", str(args.max_concurrent), "--request-timeout", str(REQUEST_TIMEOUT),
           "--max-body-bytes", str(MAX_BODY), "--max-header-bytes", str(16 << 10)]
    server = Launched(f"mlxdist serve N={args.ranks}", cmd)
    try:
        return _stress(args, server, port, key, expected)
    finally:
        server.stop()  # a no-op after the clean stop


def _wait_ready(server: Launched, client: "Client", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited: {server.proc.stderr.read()[-1500:]}")
        try:
            if _split(client.health())[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not come up in {timeout:g} s")


def _stress(args: argparse.Namespace, server: Launched, port: int, key: str,
            expected: Dict[str, str]) -> Dict[str, Any]:
    client = Client(port, key, args.max_tokens, expected)
    _wait_ready(server, client)
    # the server's stderr goes to a pipe: drain it, or a full pipe would stall rank 0
    stderr: List[str] = []
    threading.Thread(target=lambda: stderr.extend(server.proc.stderr), daemon=True).start()
    pids = rank_pids(os.getsid(server.proc.pid))
    rng = random.Random(args.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    sampler = Sampler(pids)
    sampler.start()
    deadline = time.monotonic() + args.max_seconds
    counts, failures, lock = Counter(), [], threading.Lock()

    def one(i: int) -> None:
        if time.monotonic() > deadline:
            return
        kind = kinds[i]
        try:
            problem = getattr(client, kind)(random.Random(args.seed * 1_000_003 + i))
        except Exception as e:  # noqa: BLE001 - a client-side failure is a failed request
            problem = f"{type(e).__name__}: {e}"
        with lock:
            counts[kind] += 1
            if problem:
                failures.append({"request": i, "kind": kind, "problem": problem})

    tic = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(args.requests)))
    seconds = time.monotonic() - tic
    final = client.normal(random.Random(0))
    health = client.health()
    sampler.done.set()
    sampler.join()
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    os.kill(pids[0], signal.SIGINT)  # Ctrl-C to rank 0: every rank stops, status 0
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.stop()
        code = None
    time.sleep(0.5)
    text = "".join(stderr)
    growth = [p - s for p, s in zip(sampler.peak_mb, sampler.start_mb)]
    checks = {
        "every request done in time": sum(counts.values()) == args.requests,
        "every answer right": not failures,
        "every rank alive to the end": not sampler.lost and len(alive) == len(pids) == args.ranks,
        f"RSS growth within {args.rss_bound_mb} MB per rank": max(growth) <= args.rss_bound_mb,
        "no traceback": "Traceback" not in text and "Exception occurred" not in text,
        "serving at the end": final is None and _split(health)[0] == 200,
        "clean stop (status 0)": code == 0,
    }
    return {
        "command": " ".join(sys.argv), "ranks": args.ranks, "requests": sum(counts.values()), "kinds": dict(counts),
        "seconds": round(seconds, 1), "requests_per_s": round(sum(counts.values()) / seconds, 1),
        "rss_start_mb": [round(v, 1) for v in sampler.start_mb], "rss_peak_mb": [round(v, 1) for v in sampler.peak_mb],
        "rss_bound_mb": args.rss_bound_mb, "late_slow_answered": len(client.late_answered),
        "failures": failures[:20], "failed": len(failures),
        "final": final, "checks": checks, "passed": all(checks.values()), "stderr_tail": text[-2000:],
    }


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench stress", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (e.g. one written by python -m mlxdist.synth)")
    p.add_argument("--ranks", type=arg_int(), default=2)
    p.add_argument("--requests", type=arg_int(), default=10000)
    p.add_argument("--clients", type=arg_int(), default=16, help="requests in flight at once (default %(default)s)")
    p.add_argument("--max-tokens", type=arg_int(), default=6, help="tokens of each normal answer (default %(default)s)")
    p.add_argument("--max-concurrent", type=arg_int(), default=16, help="the server's --max-concurrent")
    p.add_argument("--max-seconds", type=arg_number(), default=1800, help="requests not started by then fail the run")
    p.add_argument("--rss-bound-mb", type=arg_number(), default=300,
                   help="allowed growth of each rank's RSS from its size once serving (default %(default)s)")
    p.add_argument("--seed", type=arg_int(), default=0)
    p.add_argument("--mpirun", default=None, help="the launcher (default: the environment's mpirun)")
    p.add_argument("--out", default=None, help="write the report (JSON) here")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    args.model = str(Path(args.model).resolve())
    report = run(args)
    text = json.dumps({k: v for k, v in report.items() if k != "stderr_tail"}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if not report["passed"]:
        print(report["stderr_tail"], file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
