"""Serving through a lost rank (python -m mlxdist.serve --ranks 3: the
front, front/job.py's RankJob, front/recovery.py) and a job file through
one (python -m mlxdist.supervise), under real mpirun on this machine.

One front of 3 ranks (one sequence at a time: --max-concurrent 1; the live
stream held at its 20th token by a test fault, so that the fault comes
while it is live however slow the machine) takes its faults in sequence:
rank 1 stopped (SIGSTOP, a sleeping Mac) while a stream is live and a plain
request waits behind it; the front grows back to
3 at a quiet moment (not while a stream is live); then rank 2 killed (kill
-9). Each time: a new request meanwhile is answered 503 with Retry-After at
once (unless the job on the ranks left serves it already: a kill's recovery
can be over within a second; one of the two must be 503), the stream under
way ends with an error event within the heartbeat plus 5 s, the plain
request that had no answer yet is held and answered by the job on the
ranks left (a stream and an Anthropic Messages request waiting too at
rank 1's stop, the stream's text once), a client told 503 is answered once
it retries, the front serves again on the 2 ranks left within 60 s, and
greedy answers equal mlx-lm's (the held ones: an undisturbed run's). A
plain request caught mid-decode is held too: front_link.py's, on the
namespace hosts (test_recovery_hosts.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, mpirun_env
from test_front import EOS, Front
from test_serve import KEY, alone, rank_pids_with

HEARTBEAT = 5.0
REGROW_EVERY = 8.0
ANSWERED_WITHIN = HEARTBEAT + 5
SERVING_AGAIN_WITHIN = 60.0
PROMPT = "Request 3: tokens tokens"
# Waits behind the live stream, unanswered when the fault hits; answered again by the next job.
HELD = {"prompt": PROMPT, "max_tokens": 400, "logit_bias": {str(EOS): -100}}
# The live stream (held at its HELD_AT-th token by a test fault), and a stream that outlasts the wait
# for growing back (not held).
LIVE_TOKENS = 4000
LONG_TOKENS = 3999
HELD_AT = 20
MESSAGE = {"model": "m", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]}


def wait_for(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` holds; AssertionError after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"no {what} within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def status_of(front):
    """/health's status (None where the front did not answer in time)."""
    try:
        return front.health()[2]["status"]
    except OSError:
        return None


class Live:
    """A long stream and then a plain request through the front, each in a
    thread of its own, with when each got its answer or its end; ready once
    the stream has chunks and the plain one has come, unanswered."""

    def __init__(self, front):
        self.plain, self.stream, self.events = {}, {}, []
        threading.Thread(target=self._stream, args=(front,), daemon=True).start()
        wait_for(lambda: len(self.events) >= 2, 60, "stream events")
        threading.Thread(target=self._plain, args=(front,), daemon=True).start()
        wait_for(lambda: front.metrics()["mlxdist_requests_queued{}"] >= 1 or "at" in self.plain, 30,
                 "the plain request forwarded")
        assert "at" not in self.plain, self.plain

    def _plain(self, front):
        try:
            self.plain["answer"] = front.post("/v1/completions", HELD)
        except OSError as e:
            self.plain["answer"] = (None, None, repr(e))
        self.plain["at"] = time.monotonic()

    def _stream(self, front):
        import httpx

        body = {"prompt": PROMPT, "max_tokens": LIVE_TOKENS, "stream": True, "logit_bias": {str(EOS): -100}}
        try:
            with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.HTTPError as e:
            self.events.append(f"connection: {e!r}")
        self.stream["at"] = time.monotonic()


def held_stream(front, got):
    """A greedy stream of 8 tokens; its data lines into ``got["events"]``, when it ended into ``got["at"]``."""
    import httpx

    got["events"] = []
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    try:
        with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got["events"].append(line[6:])
    except httpx.HTTPError as e:
        got["events"].append(f"connection: {e!r}")
    got["at"] = time.monotonic()


def held_message(front, got):
    """An Anthropic Messages request (not streamed): its answer into ``got["answer"]``."""
    try:
        got["answer"] = front.post("/v1/messages", MESSAGE, timeout=180)
    except OSError as e:
        got["answer"] = (None, None, repr(e))


def check_fault(front, victim_rank, sig, expected, undisturbed, queued_stream=False):
    """``sig`` to rank ``victim_rank`` with a stream live and a plain
    request queued behind it: the stream ends within the heartbeat + 5 s (an
    error event after a chunk whose finish_reason is "error"), the plain one
    (no answer yet) is held and answered by the next job with
    ``undisturbed``'s text; with ``queued_stream``, a stream and a Messages
    request queued too (no chunk yet) are held as well: the stream streams ``expected`` once, the
    Messages answer's content is the undisturbed one's; a request meanwhile 503 with
    Retry-After at once and answered once it retries after recovery (or
    answered by the next job, where it serves already), the front serving
    again (degraded, one rank fewer) within 60 s of the fault, greedy as
    mlx-lm. The victim's pid, the recovery's record, and whether that
    request was told 503."""
    victim = front.rank_pids()[victim_rank]
    replayed = front.metrics()["mlxdist_requests_replayed_total{}"]
    before = front.health()[2]["last_recovery"]
    live = Live(front)
    queued, message = {}, {}
    if queued_stream:  # behind the live stream (--max-concurrent 1), unanswered when the fault comes
        threading.Thread(target=held_stream, args=(front, queued), daemon=True).start()
        threading.Thread(target=held_message, args=(front, message), daemon=True).start()
        wait_for(lambda: front.metrics()["mlxdist_requests_queued{}"] >= 3, 60, "the queued requests")
    assert len(live.events) <= HELD_AT + 1, "the live stream was not held: the fault comes at another moment"
    os.kill(victim, sig)
    hit = time.monotonic()
    # recovering, or already serving again: a kill's recovery can be over before the next poll
    wait_for(lambda: status_of(front) in ("recovering", "starting") or recovered(front, before), ANSWERED_WITHIN,
             "recovering")
    asked = time.monotonic()
    status, headers, body = front.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    told_503 = status == 503
    if told_503:
        assert int(headers["Retry-After"]) >= 1 and body["error"]["code"] == 503, (status, body)
        assert time.monotonic() - asked < 5  # answered at once, not held
    else:  # the next job served it
        assert status == 200 and recovered(front, before), (status, body)
    wait_for(lambda: "at" in live.stream, ANSWERED_WITHIN + 2, "the end of the live stream")
    assert live.stream["at"] - hit < ANSWERED_WITHIN
    events = [json.loads(e) for e in live.events if e.startswith("{")]
    assert "[DONE]" not in live.events and events[-1].get("error") is not None, live.events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "error", live.events[-3:]
    while status == 503:  # the client that was told 503 retries after Retry-After
        time.sleep(int(headers["Retry-After"]))
        status, headers, body = front.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert time.monotonic() - hit < SERVING_AGAIN_WITHIN, "not serving again within 60 s"
    assert status == 200 and body["choices"][0]["text"] == expected, body
    wait_for(lambda: "at" in live.plain and (not queued_stream or ("at" in queued and "answer" in message)), 120,
             "the held requests' answers")
    status, _, body = live.plain["answer"]
    assert status == 200 and body["choices"][0]["text"] == undisturbed["plain"], (status, body)
    if queued_stream:
        events = [json.loads(e) for e in queued["events"] if e.startswith("{")]
        assert queued["status"] == 200 and queued["events"][-1] == "[DONE]", queued
        assert all(e.get("error") is None for e in events), queued
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == expected, queued
        status, _, body = message["answer"]
        assert status == 200 and body["content"] == undisturbed["message"], (status, body)
    assert front.metrics()["mlxdist_requests_replayed_total{}"] - replayed == 1 + (2 if queued_stream else 0)
    status, _, health = front.health()
    assert status == 200 and health["status"] == "degraded" and health["ranks"] == 2, health
    record = health["last_recovery"]
    assert record["lost_rank"] == victim_rank and record["serving_again_after_s"] < SERVING_AGAIN_WITHIN, record
    return victim, record, told_503


def recovered(front, before) -> bool:
    """Whether the front has served again since its last recovery was ``before``."""
    try:
        return front.health()[2]["last_recovery"] != before
    except OSError:
        return False


def hold_growth_with_a_live_stream(front):
    """Growing back waits for a quiet moment: while a stream is live, past
    --regrow-every, the front stays degraded."""
    import httpx

    body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "stream": True, "logit_bias": {str(EOS): -100}}
    with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        time.sleep(REGROW_EVERY + 4)
        assert status_of(front) == "degraded"
        next(lines)  # still streaming


def test_the_front_serves_through_a_stopped_and_a_killed_rank(checkpoint):
    """python -m mlxdist.serve --ranks 3: rank 1 stopped (a Mac asleep),
    the front grows back to 3 once it answers, then rank 2 killed. Failed
    before: no front; the rank server that loses a rank ends for good."""
    path = checkpoint("qwen3_moe")
    expected = alone(path, PROMPT, 8)
    # one sequence at a time (mlx-lm decodes at least --prompt-concurrency together), and the live
    # stream held at its HELD_AT-th token (once a job): the requests sent after it wait, unanswered, until
    # the fault, however long a loaded machine takes to send them
    front = Front(path, ["--heartbeat", HEARTBEAT, "--regrow-every", REGROW_EVERY, "--max-concurrent", 1,
                         "--prompt-concurrency", 1], ranks=3,
                  env={"MLXDIST_FAULT": f"stall:max_tokens={LIVE_TOKENS},step={HELD_AT},seconds=300"})
    try:
        front.wait_for(("ok",))
        status, body = front.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})[::2]
        assert status == 200 and body["choices"][0]["text"] == expected, body
        status, body = front.post("/v1/completions", HELD)[::2]
        status2, answer = front.post("/v1/messages", MESSAGE)[::2]
        assert status == 200 and status2 == 200, (body, answer)
        undisturbed = {"plain": body["choices"][0]["text"], "message": answer["content"]}

        # (a) rank 1 stopped: the heartbeat names it
        victim, record, stop_503 = check_fault(front, 1, signal.SIGSTOP, expected, undisturbed, queued_stream=True)
        assert record["detected_after_s"] == HEARTBEAT and record["host"] == "localhost", record  # no hostfile
        hold_growth_with_a_live_stream(front)
        try:
            os.kill(victim, signal.SIGCONT)  # mpirun ended it; a stopped Mac wakes up
        except ProcessLookupError:
            pass
        status, _, health = front.wait_for(("ok",), timeout=REGROW_EVERY + 90)
        assert health["ranks"] == 3 and len(front.rank_pids()) == 3, health
        assert front.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})[2]["choices"][0]["text"] == expected

        # (c) rank 2 killed: the launcher says so at once
        _, record, kill_503 = check_fault(front, 2, signal.SIGKILL, expected, undisturbed)
        assert record["detected_after_s"] == 0.0, record
        assert stop_503 or kill_503, "no request meanwhile was answered 503"
        assert front.metrics()["mlxdist_recoveries_total{}"] == 2
    except BaseException:
        front.kill()
        raise
    assert front.stop() == 0, front.stderr()[-3000:]


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
        ranks = _ranks_of(str(jobs))
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


def _ranks_of(marker):
    """The rank processes whose command line holds ``marker``, by rank (the launcher's own have none)."""
    return rank_pids_with([marker])


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


def test_the_survivors_are_planned_as_supervise_plans_them(tmp_path):
    """The loss read from the job's words (the heartbeat's line: its host and
    silence; the launcher's report: none), the lost slot dropped, budgets
    kept per survivor, and rank 0 kept on this machine (the front reaches
    it on loopback): another local rank takes its place, none is an error."""
    from mlxdist.cli.relaunch import RankSlot
    from mlxdist.errors import UserError
    from mlxdist.front.recovery import Plan, read_loss, survivors_plan

    here = socket.gethostname()
    slots = [RankSlot(here, 4.0), RankSlot("mac-b", 1.0), RankSlot(here, 2.0)]
    said = f"mlxdist: error: rank 0 (host {here}) sent no heartbeat for 5.0 s: lost\n"
    loss = read_loss(said, slots, 100.0)
    assert (loss.ranks, loss.hosts, loss.silent_s) == ([0], [here], 5.0)
    assert loss.record(112.5)["serving_again_after_s"] == 17.5 and loss.record(112.5)["detected_after_s"] == 5.0
    plan = survivors_plan(Plan(slots, ["--model", "M", "--rank-memory", "4,1,2"]), loss, 1, None, str(tmp_path))
    assert plan.slots == [RankSlot(here, 2.0), RankSlot("mac-b", 1.0)]
    assert plan.serve_args == ["--model", "M", "--rank-memory", "2,1"]
    killed = "prterun noticed that process rank 2 with PID 1 on node x exited on\nsignal 9 (Killed).\n"
    assert read_loss(killed, slots, 100.0).silent_s == 0.0
    # a rank killed on another host, its peer's connection broken before the launcher says so
    peer_gone = ("An MPI communication peer process has unexpectedly disconnected.  This\nusually indicates "
                 "a failure in the peer process\n  Local host: " + here + "\n  Local PID:  32367\n"
                 "  Peer host:  mac-b\n----\nprterun has exited due to process rank 0 with PID 0 on node x calling"
                 ' "abort".\n')
    assert read_loss(peer_gone, slots, 100.0).ranks == [1]
    assert read_loss(peer_gone.replace("mac-b", here), slots, 100.0) is None  # its own host: no loss read
    assert read_loss("mlxdist: error: cannot load M\nexited with non-zero status", slots, 100.0) is None
    with pytest.raises(UserError, match="no rank is left on this machine"):
        survivors_plan(Plan(slots[:2], []), read_loss(said, slots[:2], 100.0), 1, None, str(tmp_path))
    with pytest.raises(UserError, match=r"only 1 rank would remain \(--min-ranks 2\)"):
        survivors_plan(Plan(slots[:2], []), read_loss(killed.replace("rank 2", "rank 1"), slots[:2], 1.0), 2, None,
                       str(tmp_path))

