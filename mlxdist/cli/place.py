"""``python -m mlxdist.place``: a placement file from a routing statistics file.

    python -m mlxdist.place ROUTING.json --ranks N [--duplicates R] [--rank-memory A,B,...] -o PLACEMENT.json

Reads the routed slots per expert a job recorded (``--record-routing``),
places each layer's experts so that the predicted per-rank load is as even
as the memory allows (``model/balance.py``), writes the placement that
``--placement`` reads, and prints the predicted imbalance ratio,
(max - mean) / mean of per-rank routed slots per layer, averaged over the
layers: even placement's and this one's.
"""

import argparse
import sys
from typing import List, Optional

from mlxdist.inputs.digits import arg_int
from mlxdist.errors import UserError, say_error
from mlxdist.model.balance import balanced, imbalance
from mlxdist.model.budgets import parse_rank_memory
from mlxdist.values.placement import Placement
from mlxdist.model.routing_file import RoutingStats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.place", description=__doc__.splitlines()[0])
    p.add_argument("routing", help="routing statistics file (written by --record-routing)")
    p.add_argument("--ranks", type=arg_int(1), required=True, help="ranks of the job the placement is for")
    p.add_argument("--duplicates", "--replicas", type=arg_int(0), default=0,
                   help="extra expert slots per rank for duplicates of the hottest experts (default "
                        "%(default)s; --replicas: its old name, kept for one release)")
    p.add_argument("--rank-memory", default=None, metavar="A,B,...",
                   help="GB of expert weights per rank: each rank holds experts in proportion (default: equal)")
    p.add_argument("-o", "--output", required=True, help="placement JSON file to write")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        routing = RoutingStats.load(args.routing)
        budgets = parse_rank_memory(args.rank_memory, args.ranks) if args.rank_memory else None
        if isinstance(budgets, dict):
            raise UserError("mlxdist.place plans for ranks, not hosts: give --rank-memory per rank, in the job's "
                            "rank order (A,B,...)")
        plan = balanced(routing.layers, args.ranks, args.duplicates, budgets)
        even = Placement.even({l: len(c) for l, c in routing.layers.items()}, args.ranks, budgets=budgets)
        plan.save(args.output)
    except UserError as e:
        say_error(str(e))
        return 1
    except OSError as e:
        say_error(f"cannot write {args.output}: {e.strerror}")
        return 1
    held = plan.held_counts()
    per_rank = [max(c[r] for c in held.values()) for r in range(args.ranks)]
    print(f"{len(routing.layers)} layers, {routing.tokens if routing.tokens is not None else '?'} tokens routed; "
          f"experts held per rank (most in a layer): {per_rank}")
    print(f"predicted imbalance ratio (max - mean) / mean: even {imbalance(even, routing.layers):.3f}, "
          f"balanced{f' + {args.duplicates} duplicate slot(s) per rank' if args.duplicates else ''} "
          f"{imbalance(plan, routing.layers):.3f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
