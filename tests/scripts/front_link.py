"""Run on host0 of tests/netns.py's hosts (test_recovery_hosts.py): the
front at --ranks 3 over host0, host1 and host2, and three faults of host2
in turn, each while a stream and a plain request are live (the stream ends
with an error event, the plain one, unanswered, is held and answered by the
job on the ranks left with an undisturbed run's text; a request sent once
the front noticed is answered 503, or by the next job where it already
serves):

1. its rank stopped (SIGSTOP: a Mac asleep), then continued: grown back;
2. its cable pulled: no growing back while it is out; plugged back in: grown back;
3. its rank killed (``kill -9``).

Raises AssertionError on the first thing that is not as it should be;
prints one JSON line of the times measured (seconds from each fault, and
from the plug for growing back).

    python front_link.py MODEL HOSTFILE SWITCH_NS VETH EXPECTED_TEXT KEY HOST2_NS
"""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HEARTBEAT, REGROW_EVERY = 5.0, 8.0
PROMPT = "Request 3: tokens tokens"
EOS = 2
# Each fault's stream is held at its HELD_AT-th token (a test fault, once a job), the plain request
# beside it with it: both are live when the fault comes, however slow the machine.
LIVE_TOKENS, HELD_AT = 3000, 20
HEALTH_SAID = collections.deque(maxlen=6)  # the last statuses /health gave, for a failure's message


def main() -> None:
    model, hostfile, switch, veth, expected, key, host2 = sys.argv[1:8]
    front = subprocess.Popen([sys.executable, "-m", "mlxdist.serve", "--ranks", "3", "--hostfile", hostfile,
                              "--model", model, "--port", "0", "--api-key", key, "--heartbeat", str(HEARTBEAT),
                              "--regrow-every", str(REGROW_EVERY)], stdin=subprocess.DEVNULL,
                             env={**os.environ, "MLXDIST_FAULT": f"stall:max_tokens={LIVE_TOKENS},step={HELD_AT},"
                                                                 f"seconds=300"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said, port = [], []

    def read():
        for line in front.stderr:
            said.append(line)
            found = re.search(r"mlxdist: front on http://127\.0\.0\.1:(\d+) ", line)
            if found:
                port.append(int(found.group(1)))

    threading.Thread(target=read, daemon=True).start()
    try:
        times = run(port, key, expected, switch, veth, host2)
    except BaseException:
        sys.stderr.write("".join(said)[-6000:])
        front.kill()
        raise
    front.send_signal(signal.SIGINT)
    assert front.wait(90) == 0, "".join(said)[-3000:]
    print(json.dumps(times))


def call(url, key, path, body=None, timeout=120):
    """(status, headers, parsed body) of one request; status None where the connection failed."""
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"{}")
    except OSError as e:
        return None, None, repr(e)


def queued(url, key) -> float:
    """The front's mlxdist_requests_queued (requests forwarded, no byte of answer yet)."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^mlxdist_requests_queued (\S+)$", text, re.M).group(1))


def wait(predicate, timeout, what):
    """When ``predicate()`` first held (time.monotonic()); AssertionError
    past ``timeout`` s, saying how long the slowest check took (a starved
    machine, not the front, where that is most of it)."""
    start, slowest = time.monotonic(), 0.0
    while True:
        asked = time.monotonic()
        if predicate():
            return time.monotonic()
        slowest = max(slowest, time.monotonic() - asked)
        assert time.monotonic() - start < timeout, (f"no {what} within {timeout} s (the slowest check took "
                                                    f"{slowest:.1f} s; /health said {list(HEALTH_SAID)})")
        time.sleep(0.1)


def rank_on(namespace: str) -> int:
    """The pid of the rank process running in network namespace ``namespace``
    (its launcher's daemon there is not one)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"mlxdist.serve" in args and b"--ranks" not in args:
            return int(pid)
    raise AssertionError(f"no rank in {namespace}: {pids}")


def run(port, key, expected, switch, veth, host2):
    wait(lambda: port, 120, "front line")
    url = f"http://127.0.0.1:{port[0]}"

    def health() -> dict:
        got = call(url, key, "/health", timeout=10)[2]
        got = got if isinstance(got, dict) else {"status": got}
        HEALTH_SAID.append(got.get("status"))
        return got

    def state():
        return health().get("status")

    wait(lambda: state() == "ok", 300, "serving on 3 ranks")
    greedy = {"prompt": PROMPT, "max_tokens": 8}
    assert call(url, key, "/v1/completions", greedy)[2]["choices"][0]["text"] == expected
    held = {**greedy, "max_tokens": 160, "logit_bias": {str(EOS): -100}}
    undisturbed = call(url, key, "/v1/completions", held)[2]["choices"][0]["text"]
    times = {}

    victim = rank_on(host2)
    times.update(fault(url, key, health, greedy, held, expected, undisturbed, "stop",
                       lambda: os.kill(victim, signal.SIGSTOP)))
    try:
        os.kill(victim, signal.SIGCONT)  # the launcher ended it; a stopped Mac wakes up
    except ProcessLookupError:
        pass
    continued = time.monotonic()
    times["stop_grown_back"] = wait(lambda: state() == "ok", REGROW_EVERY + 120, "growing back") - continued

    times.update(fault(url, key, health, greedy, held, expected, undisturbed, "cable",
                       lambda: subprocess.run(["ip", "-n", switch, "link", "set", veth, "down"], check=True)))
    time.sleep(REGROW_EVERY + 25)  # host2 does not answer: no growing back
    assert state() == "degraded"
    subprocess.run(["ip", "-n", switch, "link", "set", veth, "up"], check=True)
    plugged = time.monotonic()
    times["cable_grown_back_after_plug"] = wait(lambda: state() == "ok", REGROW_EVERY + 120, "growing back") - plugged
    assert call(url, key, "/health")[2]["ranks"] == 3
    assert call(url, key, "/v1/completions", greedy)[2]["choices"][0]["text"] == expected

    victim = rank_on(host2)
    times.update(fault(url, key, health, greedy, held, expected, undisturbed, "kill",
                       lambda: os.kill(victim, signal.SIGKILL)))
    return {k: round(v, 2) for k, v in times.items()}


def fault(url, key, health, greedy, held, expected, undisturbed, name, inflict) -> dict:
    """``inflict`` (a fault of host2) while a stream and a plain request are
    live; the checks of the module's docstring until serving on host0 and
    host1 again. The times from the fault, as ``<name>_<what>``, and
    ``<name>_503``: 1 where the request sent once the loss was noticed was
    answered 503, 0 where the job on host0 and host1 already served it (a
    killed rank's recovery can take under a second)."""
    live, events = {}, []
    state = lambda: health().get("status")  # noqa: E731
    before = health().get("last_recovery")

    def plain():
        live["plain"] = call(url, key, "/v1/completions", held, timeout=180)
        live["plain_at"] = time.monotonic()

    def stream():
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {**greedy, "max_tokens": LIVE_TOKENS, "stream": True, "logit_bias": {str(EOS): -100}}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode().strip())
        except OSError as e:
            events.append(f"connection: {e!r}")
        live["stream_at"] = time.monotonic()

    threading.Thread(target=stream, daemon=True).start()
    wait(lambda: len(events) >= 2, 120, "stream events")
    threading.Thread(target=plain, daemon=True).start()
    wait(lambda: queued(url, key) >= 1 or "plain_at" in live, 30, "the plain request forwarded")
    assert "plain_at" not in live, live
    assert len(events) <= HELD_AT + 1, (name, "the stream was not held: the fault comes at another moment")
    inflict()
    hit = time.monotonic()

    def noticed():  # recovering, or already recovered: a poll can miss a window of a second
        got = health()
        return got.get("status") in ("recovering", "starting") or got.get("last_recovery") != before

    times = {"recovering": wait(noticed, HEARTBEAT + 5, "recovering") - hit}
    status, headers, body = call(url, key, "/v1/completions", greedy, timeout=10)
    if status == 200:  # the new job served it: it must have recovered by then
        assert body["choices"][0]["text"] == expected and health().get("last_recovery") != before, (name, body)
    else:
        assert status == 503 and headers["Retry-After"], (name, status, body)
    times["503"] = float(status == 503)
    times["answered"] = wait(lambda: "stream_at" in live, HEARTBEAT + 7, "the stream's end") - hit
    assert live["stream_at"] - hit < HEARTBEAT + 5, (name, times)
    assert events[-1].startswith("{") and json.loads(events[-1]).get("error"), (name, events[-3:])
    times["serving_again"] = wait(lambda: state() == "degraded", 60, "serving on 2 ranks") - hit
    status, _, health = call(url, key, "/health")
    assert health["ranks"] == 2 and health["hosts"] == ["host0", "host1"], (name, health)
    assert health["last_recovery"]["lost_rank"] == 2 and health["last_recovery"]["host"] == "host2", (name, health)
    assert call(url, key, "/v1/completions", greedy)[2]["choices"][0]["text"] == expected, name
    times["held_answered"] = wait(lambda: "plain_at" in live, 120, "the held request's answer") - hit
    assert live["plain"][0] == 200 and live["plain"][2]["choices"][0]["text"] == undisturbed, (name, live["plain"])
    return {f"{name}_{k}": v for k, v in times.items()}


if __name__ == "__main__":
    main()
