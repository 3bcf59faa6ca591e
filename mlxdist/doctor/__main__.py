"""``python -m mlxdist.doctor [--model M] [--backend B] [--json]``, launched
like any job:

    launch/mpirun -np 2 --hostfile H python -m mlxdist.doctor --model M
    mlx.launch --hostfile hosts.json -- python -m mlxdist.doctor --model M

Rank 0 prints one table (a row per rank, then the link matrix), a line per
problem, per warning (what differs between ranks but need not stop a job)
and per note; the exit status is 1 when there is a problem, else 0. A probe
that fails on some rank ends the doctor on every rank within seconds, with
a line per failing rank (``together.py``).
"""

import argparse
import json
import sys

from mlxdist.cli.run import rank_memory_arg
from mlxdist.config import KV_RESERVE_TOKENS, kv_reserve_tokens_arg
from mlxdist.inputs.digits import arg_int, arg_number
from mlxdist.dispatch import DISPATCH_MODES
from mlxdist.doctor import facts, links, report
from mlxdist.doctor.fit import fit_problems
from mlxdist.doctor.together import gathered
from mlxdist.errors import StepFailed, say_error
from mlxdist.runtime.world import BACKENDS, init_world
from mlxdist.runtime.exits import run_or_abort, set_exit_code
from mlxdist.runtime.launcher import launcher_rank


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.doctor", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or hub id: its presence, fingerprint and fit on every rank")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="MLX's transport to check (default as a job's)")
    p.add_argument("--min-disk", type=arg_number(0), default=1.0, metavar="GB",
                   help="free GB wanted where models are cached (default %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    fit_opts = p.add_argument_group("the model's fit, as a load with these options reckons it (docs/memory.md)")
    fit_opts.add_argument("--mode", "--dispatch", choices=DISPATCH_MODES, default="auto",
                          help="the mode (default %(default)s; --dispatch: its old name, kept for one release)")
    fit_opts.add_argument("--rank-memory", metavar="HOST=GB,...|A,B,...", type=rank_memory_arg, default=None,
                          help="GB of expert weights each host or rank may keep resident (default: from the memory "
                               "each rank finds)")
    fit_opts.add_argument("--kv-reserve-tokens", type=kv_reserve_tokens_arg, default=KV_RESERVE_TOKENS, metavar="N",
                          help="KV-cache tokens reserved per rank (default %(default)s)")
    fit_opts.add_argument("--expert-capacity", type=arg_int(1), default=None, metavar="N",
                          help="experts each rank keeps resident per layer")
    fit_opts.add_argument("--memory-budget", type=arg_number(above=0), default=None, metavar="GB",
                          help="weights each rank may hold (sets its expert capacity)")
    args = p.parse_args(argv)
    try:
        world = init_world(args.backend)
    except RuntimeError as e:  # the same on every rank: rank 0 says it
        if launcher_rank() == 0:
            say_error(f"the job did not start: {e}")
        return 1
    code = run_or_abort(world, examine, world, args)
    set_exit_code(code)
    return code


def examine(world, args) -> int:
    """Every rank: the probes, each gathered in lockstep, then rank 0's
    report. Returns the exit status."""
    try:
        ranks = gathered(world, "could not be examined", lambda: facts.rank_facts(world, args.model))
        addresses = links.addresses(world)
        reach = links.reachability(world, addresses)
        timing = links.timings(world)
        found = report.problems(ranks, addresses, reach, args.min_disk, fit_problems(world, ranks, args))
        gathered(world, "could not print the report",
                 lambda: _print(args, ranks, addresses, reach, timing, found) if world.is_root else None)
    except StepFailed as e:
        if world.is_root:
            errors = getattr(e, "rank_errors", None) or [str(e)]
            for rank, error in enumerate(errors):
                if error:
                    print(f"mlxdist doctor: problem: rank {rank} {error}" if len(errors) == world.size else
                          f"mlxdist doctor: problem: {error}", file=sys.stderr, flush=True)
        return 1
    return 1 if found else 0


def _print(args, ranks, addresses, reach, timing, found) -> None:
    """Rank 0: the table (or the JSON object), then a line per problem, warning and note."""
    warnings, notes = report.warnings(ranks), report.notes(ranks)
    if args.json:
        print(json.dumps({"ranks": ranks, "addresses": addresses, "reach": reach, "timing": timing,
                          "problems": found, "warnings": warnings, "notes": notes}), flush=True)
    else:
        print(report.table(ranks, addresses, timing), flush=True)
    for kind, lines in (("problem", found), ("warning", warnings), ("note", notes)):
        for line in lines:
            print(f"mlxdist doctor: {kind}: {line}", file=sys.stderr, flush=True)
    if not found:
        print("mlxdist doctor: ready", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
