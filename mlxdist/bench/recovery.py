"""``python -m mlxdist.bench recovery``: how long a served model takes to
notice a lost rank and to serve again on the ranks left, per fault.

    python -m mlxdist.bench recovery --model DIR [--ranks 3] [--faults stop,kill] [--heartbeat 5] [--json]

Starts the rank job the way the front does (``front/job.py``'s ``RankJob``:
mpirun on this machine), checks one greedy answer, then for each fault in
turn, while a long stream is being answered: ``stop`` sends SIGSTOP to rank
``--victim`` (a Mac asleep), ``kill`` SIGKILL (a process lost). Measured from
the fault: when the job knew (state ``recovering``), when the live stream got
its end, when the job served again on one rank fewer and answered the same
greedy request (and whether the answer equals the one before); then how long
growing back to ``--ranks`` took once allowed (``--regrow-every``).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

from mlxdist.inputs.digits import arg_duration, arg_int
from mlxdist.runtime.heartbeat import arg_heartbeat

FAULTS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}
PROMPT = "Request 3: tokens tokens"


def _post(job, body: Dict[str, Any], timeout: float = 300) -> Optional[dict]:
    """The rank server's answer to a completion (None: not 200)."""
    req = urllib.request.Request(job.base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {job.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _stream_until_end(job, ended: Dict[str, float]) -> None:
    """A long stream; ``ended["at"]``: when its end (an error event, a dropped connection) came."""
    req = urllib.request.Request(job.base_url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": PROMPT, "max_tokens": 4000, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {job.api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                ended.setdefault("first", time.monotonic())
                if line.startswith(b"data: ") and b'"error"' in line:
                    break
    except OSError:
        pass
    ended["at"] = time.monotonic()


def rank_pids(launcher_pid: int) -> List[int]:
    """The local rank processes of the job whose launcher is ``launcher_pid``,
    by rank (the launcher's rank variable where the system shows it, else in
    the order they started)."""
    listing = subprocess.run(["ps", "-A", "-o", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in listing.splitlines():
        pid = int(line.split()[0])
        try:
            if os.getsid(pid) == launcher_pid and "-m mlxdist.serve" in line and not any(
                    n in line for n in ("prterun", "mpirun", "mlx.launch")):
                pids.append(pid)
        except OSError:
            continue
    return sorted(pids, key=lambda pid: (launcher_rank_of(pid), pid))


def launcher_rank_of(pid: int) -> int:
    """The rank mpirun or mlx.launch gave process ``pid`` (-1 where unknown)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return -1
    for name in (b"OMPI_COMM_WORLD_RANK", b"MLX_RANK"):
        if name in env:
            return int(env[name])
    return -1


def _wait(predicate, timeout: float) -> Optional[float]:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.01)
    return time.monotonic()


def one_fault(job, fault: str, victim: int, ranks: int, reference: str, max_tokens: int,
              regrow_every: float) -> Dict[str, Any]:
    """One fault while a stream is live: the times from the fault, in seconds."""
    pid = rank_pids(job.launcher_pid)[victim]
    ended: Dict[str, float] = {}
    threading.Thread(target=_stream_until_end, args=(job, ended), daemon=True).start()
    if _wait(lambda: "first" in ended or "at" in ended, 120) is None or "first" not in ended:
        raise RuntimeError("the live stream before the fault was not answered")
    os.kill(pid, FAULTS[fault])
    hit = time.monotonic()
    known = _wait(lambda: job.state == "recovering", 120)
    serving = _wait(lambda: job.state in ("ok", "degraded", "stopped"), 300)
    answer = _post(job, {"prompt": PROMPT, "max_tokens": max_tokens}) if job.state != "stopped" else None
    answered = time.monotonic()
    _wait(lambda: "at" in ended, 60)
    if fault == "stop":
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    degraded_ranks = job.ranks
    regrown = _wait(lambda: job.state == "ok" and job.ranks == ranks, regrow_every + 120)
    return {
        "fault": fault, "victim": victim, "ranks_left": degraded_ranks,
        "detected_s": None if known is None else round(known - hit, 3),
        "stream_ended_s": round(ended["at"] - hit, 3) if "at" in ended else None,
        "serving_again_s": None if serving is None else round(serving - hit, 3),
        "answered_again_s": round(answered - hit, 3) if answer else None,
        "answer_equal": bool(answer) and answer["choices"][0]["text"] == reference,
        "grown_back_s": None if regrown is None else round(regrown - hit, 3),
        "last_recovery": job.last_recovery,
    }


def _heartbeat_seconds(text: str) -> float:
    """``--heartbeat``: ``runtime/heartbeat.py``'s seconds; not off (the front needs one)."""
    seconds = arg_heartbeat(text)
    if seconds is None:
        raise argparse.ArgumentTypeError("the front needs a heartbeat to notice a lost rank: not off")
    return seconds


def main(argv: Optional[List[str]] = None) -> int:
    from mlxdist.front.job import JobSpec, RankJob

    p = argparse.ArgumentParser(prog="python -m mlxdist.bench recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ranks", type=arg_int(2), default=3)
    p.add_argument("--victim", type=arg_int(1), default=None, help="the rank to fault (default: the last)")
    p.add_argument("--faults", default="stop,kill", help="comma-separated, in turn: stop, kill (default %(default)s)")
    p.add_argument("--heartbeat", type=_heartbeat_seconds, default=5.0,
                   help="seconds a rank may be silent before it is lost (default %(default)s; at least 1)")
    p.add_argument("--regrow-every", type=arg_duration(), default=10.0)
    p.add_argument("-g", "--generation-tokens", type=arg_int(1), default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    faults = args.faults.split(",")
    if not faults or any(f not in FAULTS for f in faults):
        p.error(f"--faults: a comma-separated list of {', '.join(FAULTS)}, not {args.faults!r:.60}")
    victim = args.ranks - 1 if args.victim is None else args.victim
    if victim >= args.ranks:
        p.error(f"--victim must be a rank from 1 to {args.ranks - 1}")
    job = RankJob(JobSpec(args.ranks, ["--model", args.model], heartbeat=args.heartbeat,
                          regrow_every=args.regrow_every))
    job.start()
    results = []
    try:
        if _wait(lambda: job.state in ("ok", "stopped"), 600) is None or job.state != "ok":
            print(f"python -m mlxdist.bench recovery: the job did not serve: {job.error}", file=sys.stderr)
            return 1
        reference = _post(job, {"prompt": PROMPT, "max_tokens": args.generation_tokens})["choices"][0]["text"]
        for fault in faults:
            results.append(one_fault(job, fault, victim, args.ranks, reference, args.generation_tokens,
                                     args.regrow_every))
    finally:
        job.stop_blocking()
    report = {"model": args.model, "ranks": args.ranks, "heartbeat_s": args.heartbeat,
              "regrow_every_s": args.regrow_every, "faults": results}
    if args.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(f"{r['fault']} rank {r['victim']}: known after {r['detected_s']} s, stream ended after "
                  f"{r['stream_ended_s']} s, serving on {r['ranks_left']} ranks after {r['serving_again_s']} s "
                  f"(answered after {r['answered_again_s']} s, equal: {r['answer_equal']}), back on "
                  f"{args.ranks} after {r['grown_back_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
