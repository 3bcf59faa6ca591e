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

What counts as a lost rank and how the job is planned again is
``cli/relaunch.py``'s, which the serving front (``mlxdist/front/``) uses too.

This is for the modes whose running job cannot survive a loss (MLX's
collectives cannot continue past a dead peer). A p2p job launched with
``launch/mpirun --survive`` goes on inside the running job instead
(``runtime/survival.py``).
"""

import argparse
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from mlxdist.cli.job_file import INPUT_ERROR, load_job_file
from mlxdist.cli.job_results import recorded_ids
from mlxdist.cli.relaunch import (
    Launch, check_mpirun, find_mpirun, lost_ranks, mpirun_command, mpirun_env, option, rank_slots, replanned_args,
)
from mlxdist.inputs.digits import arg_int
from mlxdist.errors import UserError


def _job_ids(path: str) -> Set[str]:
    """The ids the output will hold once the job file is done (a bad line's
    error record included), as ``jobs.run_jobs`` writes them. Reads the file
    as the run does (bounded, never raising for a line); raises
    ``UserError`` where the run would refuse it (unreadable, duplicate ids)."""
    return {entry.id for entry in load_job_file(path, {})}


def _say(text: str) -> None:
    print(f"mlxdist.supervise: {text}", file=sys.stderr, flush=True)


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
    jobs, out = option(run_args, "--jobs"), option(run_args, "--out")
    if not jobs or not out:
        p.error("the mlxdist.run options after -- must include --jobs and --out")
    if args.min_ranks > args.ranks:
        p.error(f"--min-ranks {args.min_ranks} is more than --ranks {args.ranks}")
    try:
        wanted = _job_ids(jobs)  # the run would refuse a bad file on every start: no rank to blame
        slots = rank_slots(args.ranks, args.hostfile, option(run_args, "--rank-memory"))
        mpirun = check_mpirun(args.mpirun) if args.mpirun else find_mpirun()
    except (UserError, OSError, ValueError) as e:
        _say(f"error: {e}")
        return INPUT_ERROR
    retry_errors = "--retry-errors" in run_args
    routing = args.routing or option(run_args, "--record-routing")
    restarts: List[Dict[str, Any]] = []
    failed_at: Optional[float] = None
    while True:
        ranks = len(slots)
        cmd = mpirun_command(mpirun, slots, args.hostfile is not None, run_args)

        def start() -> Tuple[int, str]:
            """One launch to its end (ended for it ``END_GRACE`` s after a
            rank is lost: relaunch.Launch), its stderr passed on as it comes;
            the first result after a restart notes how long since the failure.
            Its status and what its stderr said."""
            _say(f"starting {ranks} rank{'s' if ranks > 1 else ''}")
            done_before = len(recorded_ids(out, retry_errors) & wanted)

            def note(line: str) -> None:
                nonlocal failed_at
                sys.stderr.write(line)
                if failed_at is not None and len(recorded_ids(out, retry_errors) & wanted) > done_before:
                    restarts[-1]["resumed_after_s"] = time.time() - failed_at
                    failed_at = None

            launch = Launch(cmd, mpirun_env(), note, stdout=None)
            try:
                code = launch.wait()
            except KeyboardInterrupt:  # the job runs in a session of its own: Ctrl-C reaches it from here
                launch.proc.send_signal(signal.SIGINT)
                launch.end(30)
                raise
            note("")  # once more after the end
            return code, launch.text()

        code, stderr = start()
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
