"""Serving through a lost rank (front/job.py's RankJob, front/recovery.py) and
a job file through one (python -m mlxdist.supervise), under real mpirun on
this machine.

One job of 3 ranks takes its faults in sequence: rank 1 stopped (SIGSTOP, a
sleeping Mac) while a plain request and a stream are live; the job grows
back to 3 once rank 1's host answers; then rank 2 killed (kill -9). Each
time: no request waits more than the heartbeat plus 5 s without an answer,
the stream ends with an error event, the job serves again on the 2 ranks
left within 60 s, and greedy answers equal mlx-lm's alone."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, mpirun_env
from test_serve import alone, launcher_rank_of

HEARTBEAT = 5.0
ANSWERED_WITHIN = HEARTBEAT + 5
SERVING_AGAIN_WITHIN = 60.0
PROMPT = "Request 3: tokens tokens"


def wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` holds; AssertionError after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"no {what} within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def in_state(job, *states):
    """A predicate: the job is in one of ``states``; AssertionError once it has stopped by itself."""
    def check():
        assert job.state != "stopped" or "stopped" in states, f"the job stopped: {job.error}"
        return job.state in states
    return check


def rank_pids(job):
    """The job's rank processes by rank (its launcher's session, the launcher's rank in their environment)."""
    sid = job.launcher_pid
    out = subprocess.run(["ps", "-A", "-o", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid = int(line.split()[0])
        try:
            if os.getsid(pid) == sid and "-m mlxdist.serve" in line and "prterun" not in line and "mpirun" not in line:
                pids.append(pid)
        except OSError:
            continue
    return sorted(pids, key=launcher_rank_of)


def post(job, body, timeout=120):
    """(status, body) of a POST to the job's rank server; (None, reason) where the connection failed."""
    req = urllib.request.Request(job.base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {job.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, repr(e)


def greedy(job, max_tokens=8):
    status, body = post(job, {"prompt": PROMPT, "max_tokens": max_tokens})
    assert status == 200, (status, body)
    return body["choices"][0]["text"]


class Live:
    """A long plain request and a long stream, each in a thread of its own,
    with when each got its answer or its end."""

    def __init__(self, job):
        self.plain, self.stream, self.events = {}, {}, []
        url, key = job.base_url, job.api_key
        threading.Thread(target=self._plain, args=(job,), daemon=True).start()
        threading.Thread(target=self._stream, args=(url, key), daemon=True).start()
        wait_for(lambda: len(self.events) >= 2, 60, "stream events")

    def _plain(self, job):
        self.plain["answer"] = post(job, {"prompt": PROMPT, "max_tokens": 4000})
        self.plain["at"] = time.monotonic()

    def _stream(self, url, key):
        import httpx

        body = {"prompt": PROMPT, "max_tokens": 4000, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.HTTPError as e:
            self.events.append(f"connection: {e!r}")
        self.stream["at"] = time.monotonic()


def check_fault(job, victim_rank, sig, full_ranks):
    """``sig`` to the job's rank ``victim_rank`` with a plain request and a
    stream live: both answered within the heartbeat + 5 s, the job serving
    again (degraded, on one rank fewer) within 60 s, greedy as mlx-lm."""
    victim = rank_pids(job)[victim_rank]
    live = Live(job)
    os.kill(victim, sig)
    hit = time.monotonic()
    noticed = wait_for(in_state(job, "recovering"), ANSWERED_WITHIN, "recovering state")
    wait_for(lambda: "at" in live.plain and "at" in live.stream, ANSWERED_WITHIN + 2, "answer to the live requests")
    status, body = live.plain["answer"]
    assert status == 503 or status is None, (status, str(body)[:500])  # 503, or the job's end under it
    assert live.plain["at"] - hit < ANSWERED_WITHIN and live.stream["at"] - hit < ANSWERED_WITHIN
    last = live.events[-1]
    assert last != "[DONE]" and ('"error"' in last or last.startswith("connection:")), live.events[-3:]
    again = wait_for(in_state(job, "ok", "degraded"), SERVING_AGAIN_WITHIN, "serving again")
    assert job.state == "degraded" and job.ranks == full_ranks - 1, (job.state, job.ranks)
    record = job.last_recovery
    assert record["lost_rank"] == victim_rank and record["serving_again_after_s"] < SERVING_AGAIN_WITHIN, record
    return victim, noticed, again


def test_a_serving_job_survives_a_stopped_and_a_killed_rank(checkpoint):
    """Failed before: no RankJob; a rank server that loses a rank ends for good."""
    from mlxdist.front.job import JobSpec, RankJob

    path = checkpoint("qwen3_moe")
    expected = alone(path, PROMPT, 8)
    job = RankJob(JobSpec(3, ["--model", str(path), "--max-concurrent", "4"], heartbeat=HEARTBEAT,
                          regrow_every=8.0, env=mpirun_env()))
    job.start()
    try:
        wait_for(in_state(job, "ok"), 180, "serving")
        assert job.ranks == 3 and job.hosts == ["localhost"] * 3 and job.last_recovery is None
        assert greedy(job) == expected

        # (a) rank 1 stopped: the heartbeat names it
        victim, _, _ = check_fault(job, 1, signal.SIGSTOP, 3)
        record = job.last_recovery
        assert record["detected_after_s"] == HEARTBEAT and record["host"] == socket.gethostname(), record
        assert greedy(job) == expected
        with job.request():  # a live request holds the growth back
            time.sleep(10)
            assert job.state == "degraded"
        try:
            os.kill(victim, signal.SIGCONT)  # mpirun ended it; a stopped Mac wakes up
        except ProcessLookupError:
            pass
        wait_for(in_state(job, "ok"), 90, "growing back")
        assert job.ranks == 3 and job.regrown_at is not None
        assert greedy(job) == expected

        # (c) rank 2 killed: the launcher says so at once
        check_fault(job, 2, signal.SIGKILL, 3)
        assert job.last_recovery["detected_after_s"] == 0.0 and job.recoveries == 2
        assert greedy(job) == expected
    finally:
        job.stop_blocking()
    assert job.state == "stopped" and job.base_url is None


def test_supervise_restarts_a_job_file_after_a_stopped_rank(checkpoint, tmp_path):
    """SIGSTOP of rank 1 under supervise: the heartbeat's line names it, the
    job file goes on on 2 ranks, every id answered once. Failed before:
    rank 0 exited 1 and supervise read a run that ended by itself."""
    model, jobs, out = checkpoint("qwen3_moe"), tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"j{i}", "prompt": f"job number {i} "}) + "\n" for i in range(40)))
    proc = subprocess.Popen([sys.executable, "-m", "mlxdist.supervise", "--ranks", "3", "--", "--model", model,
                             "--jobs", jobs, "--out", out, "-m", "24", "--batch-size", "1", "--heartbeat",
                             str(HEARTBEAT)], env=mpirun_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 2, 180, "first results")
        ranks = sorted((p for p in _session_ranks(proc.pid)), key=launcher_rank_of)
        os.kill(ranks[1], signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "restart on 2 ranks after losing rank(s) [1]" in stderr, stderr[-3000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"j{i}" for i in range(40)), ids


def _session_ranks(sid):
    out = subprocess.run(["ps", "-A", "-o", "pid=,args="], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        pid = int(line.split()[0])
        try:
            if os.getsid(pid) == sid and "-m mlxdist.run" in line and "prterun" not in line and "mpirun" not in line:
                found.append(pid)
        except OSError:
            continue
    return found


def test_hostile_job_options_are_one_line(capsys):
    """The front's --min-ranks, --regrow-every: status 2 and one line; a
    JobSpec that cannot be met is one UserError."""
    import argparse

    from mlxdist.errors import UserError
    from mlxdist.front.job import JobSpec, RankJob, add_job_options

    parser = argparse.ArgumentParser()
    add_job_options(parser.add_argument_group("job"))
    assert parser.parse_args(["--no-regrow", "--regrow-every", "30"]).regrow_every == 30
    for option, value in [("--min-ranks", "0"), ("--min-ranks", "x"), ("--min-ranks", "٣"), ("--regrow-every", "0"),
                          ("--regrow-every", "nan"), ("--regrow-every", "-1"), ("--regrow-every", "1e999"),
                          ("--regrow-every", "x" * 10_000)]:
        with pytest.raises(SystemExit) as refused:
            parser.parse_args([option, value])
        assert refused.value.code == 2
        errors = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
        assert len(errors) == 1 and len(errors[0]) < 300, (option, value, errors)
    with pytest.raises(UserError, match="--min-ranks must be from 1 to --ranks"):
        RankJob(JobSpec(2, [], min_ranks=3))
    with pytest.raises(UserError, match="--launcher must be"):
        RankJob(JobSpec(2, [], launcher="ssh"))

    class Settings:
        ranks, rank_argv = 2, ["--model", "M", "--heartbeat", "off"]

    with pytest.raises(UserError, match="not --heartbeat off"):
        JobSpec.from_settings(Settings)
