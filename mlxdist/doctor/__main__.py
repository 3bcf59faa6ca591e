"""``python -m mlxdist.doctor [--model M] [--backend B] [--json]``, launched
like any job:

    launch/mpirun -np 2 --hostfile H python -m mlxdist.doctor --model M
    mlx.launch --hostfile hosts.json -- python -m mlxdist.doctor --model M

Rank 0 prints one table (a row per rank, then the link matrix) and a line
per problem; the exit status is 1 when there is a problem, else 0.
"""

import argparse
import json
import sys

from mlxdist.doctor import facts, links, report
from mlxdist.errors import say_error
from mlxdist.runtime.world import BACKENDS, init_world, launcher_rank, set_exit_code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.doctor", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or hub id: its presence, fingerprint and fit on every rank")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="MLX's transport to check (default as a job's)")
    p.add_argument("--min-disk", type=float, default=1.0, metavar="GB",
                   help="free GB wanted where models are cached (default %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = p.parse_args(argv)
    try:
        world = init_world(args.backend)
    except RuntimeError as e:  # the same on every rank: rank 0 says it
        if launcher_rank() == 0:
            say_error(f"the job did not start: {e}")
        return 1
    ranks = world.control.allgather_json(facts.rank_facts(world, args.model))
    addresses = links.addresses(world)
    reach = links.reachability(world, addresses)
    timing = links.timings(world)
    found = report.problems(ranks, addresses, reach, args.min_disk)
    code = 1 if found else 0
    if world.is_root:
        if args.json:
            print(json.dumps({"ranks": ranks, "addresses": addresses, "reach": reach, "timing": timing,
                              "problems": found}), flush=True)
        else:
            print(report.table(ranks, addresses, timing), flush=True)
        for line in found:
            print(f"mlxdist doctor: problem: {line}", file=sys.stderr, flush=True)
        if not found:
            print("mlxdist doctor: ready", file=sys.stderr, flush=True)
    world.control.barrier()
    set_exit_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
