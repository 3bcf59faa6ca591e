"""``python -m mlxdist.supervise``: run a job file to the end through lost ranks.

    python -m mlxdist.supervise --ranks 3 [--hostfile H] -- --model M --jobs J --out O [run options]

Runs ``mpirun -np N python -m mlxdist.run ...`` and, when the job ends
before every job of the file is done, starts it again without the lost rank:
on one fewer slot (with a hostfile: one fewer slot on the host of the rank
the survivors named as gone), down to ``--min-ranks``. Placement is recomputed
for the ranks that remain (``--expert-capacity`` keeps each rank's resident
experts bounded when fewer ranks own more); the job file resumes where the
output stops, so nothing is lost or written twice, and in the exact modes the
tokens equal an undisturbed run's. Each restart is reported with the time
from the failure to the next result written.

Only a lost rank is restarted. A bad line of the job file is an error
record of its own (the run goes on); a run that refuses its input (exit
status ``job_file.INPUT_ERROR``: bad arguments, duplicate ids, ``--out`` held by
another run) is not started again, and duplicate ids are refused here before
any start.

This is for the modes whose running job cannot survive a loss (MLX's
collectives cannot continue past a dead peer). A p2p job launched with
``launch/mpirun --survive`` goes on inside the running job instead
(``runtime/survival.py``).
"""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Set, Tuple

from mlxdist.cli.job_file import INPUT_ERROR, load_job_file
from mlxdist.cli.job_results import recorded_ids
from mlxdist.errors import UserError
from mlxdist.runtime.world import LAUNCHER_FAILURE, LAUNCHER_RETRIES


def _job_ids(path: str) -> Set[str]:
    """The ids the output will hold once the job file is done (a bad line's
    error record included), as ``jobs.run_jobs`` writes them. Reads the file
    as the run does (bounded, never raising for a line); raises
    ``UserError`` where the run would refuse it (unreadable, duplicate ids)."""
    return {entry.id for entry in load_job_file(path, {})}


def _option(args: List[str], name: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """(host, slots) per line of an Open MPI hostfile."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = next((int(p.split("=", 1)[1]) for p in parts[1:] if p.startswith("slots=")), 1)
        hosts.append((parts[0], slots))
    return hosts


def lost_ranks(stderr: str) -> List[int]:
    """The ranks the survivors' reports name as gone."""
    found = set()
    for m in re.finditer(r"ranks? ([0-9, ]+) stopped \(process gone\)", stderr):
        found.update(int(r) for r in m.group(1).replace(" ", "").split(",") if r)
    return sorted(found)


def without_rank(hosts: List[Tuple[str, int]], rank: int) -> List[Tuple[str, int]]:
    """The hostfile with one slot fewer on the host that ran ``rank`` (Open
    MPI fills each host's slots in order)."""
    out, first = [], 0
    for host, slots in hosts:
        if first <= rank < first + slots:
            if slots > 1:
                out.append((host, slots - 1))
        else:
            out.append((host, slots))
        first += slots
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, run_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m mlxdist.supervise", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True, help="Ranks to start with.")
    p.add_argument("--min-ranks", type=int, default=1, help="Give up below this many.")
    p.add_argument("--hostfile", default=None)
    p.add_argument("--mpirun", default=str(Path(sys.executable).parent / "mpirun"))
    args = p.parse_args(own)
    jobs, out = _option(run_args, "--jobs"), _option(run_args, "--out")
    if not jobs or not out:
        p.error("the mlxdist.run options after -- must include --jobs and --out")
    try:
        wanted = _job_ids(jobs)
    except UserError as e:  # the run would refuse it on every start: no rank to blame
        print(f"mlxdist.supervise: error: {e}", file=sys.stderr, flush=True)
        return INPUT_ERROR
    retry_errors = "--retry-errors" in run_args
    hosts = read_hostfile(args.hostfile) if args.hostfile else None
    ranks, restarts, launcher_retries = args.ranks, [], 0
    failed_at: Optional[float] = None
    while True:
        cmd = [args.mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none"]
        if hosts is not None:
            host_arg = ",".join(f"{h}:{s}" for h, s in hosts)
            cmd += ["--host", host_arg]
        cmd += [sys.executable, "-m", "mlxdist.run", *run_args]
        print(f"mlxdist.supervise: starting {ranks} rank{'s' if ranks > 1 else ''}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")  # any bytes: never a crash
        done_before = len(recorded_ids(out, retry_errors) & wanted)
        stderr_lines = []

        def note_resume() -> None:  # the first result after a restart: how long since the failure
            nonlocal failed_at
            if failed_at is not None and len(recorded_ids(out, retry_errors) & wanted) > done_before:
                restarts[-1]["resumed_after_s"] = time.time() - failed_at
                failed_at = None

        for line in proc.stderr:
            sys.stderr.write(line)
            stderr_lines.append(line)
            note_resume()
        code = proc.wait()
        note_resume()
        left = wanted - recorded_ids(out, retry_errors)
        if code == 0 or not left:
            for r in restarts:
                print(f"mlxdist.supervise: restart on {r['ranks']} ranks after losing rank(s) {r['lost']}: "
                      f"first result {r.get('resumed_after_s', float('nan')):.1f} s after the failure",
                      file=sys.stderr, flush=True)
            return code if left else 0
        if code == INPUT_ERROR:  # the run refused its input (arguments, job file, --out held): no rank was lost
            print(f"mlxdist.supervise: error: the run refused its input (exit status {code}); not restarting",
                  file=sys.stderr, flush=True)
            return code
        if LAUNCHER_FAILURE in "".join(stderr_lines) and launcher_retries < LAUNCHER_RETRIES:
            launcher_retries += 1  # Open MPI's launcher failed before any rank ran: not a lost rank
            continue
        lost = lost_ranks("".join(stderr_lines)) or [ranks - 1]
        if ranks - len(lost) < args.min_ranks:
            print(f"mlxdist.supervise: error: {len(left)} jobs left and only {ranks - len(lost)} ranks would remain "
                  f"(--min-ranks {args.min_ranks})", file=sys.stderr, flush=True)
            return code or 1
        failed_at = time.time()
        if hosts is not None:
            for rank in sorted(lost, reverse=True):
                hosts = without_rank(hosts, rank)
        ranks -= len(lost)
        restarts.append({"ranks": ranks, "lost": lost})


if __name__ == "__main__":
    sys.exit(main())
