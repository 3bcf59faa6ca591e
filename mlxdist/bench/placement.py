"""``python -m mlxdist.bench placement``: even, balanced and balanced +
duplicates placements side by side in one run, on the same ranks.

Under mpirun (one launch per world size). The routing that the balanced
placements are made from is recorded first, by a generation of its own
(other random prompts than the timed ones, as a server's past traffic is
not its next), with the even placement. Then each placement is loaded in
turn, in ``--rounds`` interleaved rounds, and every batch size is timed
(the harness's warm-up, trials and profiling pass). Each row reports the
measured imbalance ratio, (max - mean) / mean of the routed slots each rank
computed, per MoE layer and step, averaged (``ExchangeStats.count_balance``),
and the one the policy predicted from the recorded counts.

    mpirun -np 2 python -m mlxdist.bench placement --model SKEWED -b 1,8,32 --duplicates 1
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.bench.harness import bench_case, median_row, random_prompts, run_on_every_rank, versions
from mlxdist.dispatch import DenseRanks, modes
from mlxdist.inputs.digits import arg_int, arg_number
from mlxdist.model.balance import balanced, imbalance
from mlxdist.model.checkpoint import text_config
from mlxdist.values.placement import Placement


def recorded_counts(cluster, args) -> Dict[int, List[int]]:
    """layer -> [E] routed slots of one generation with the loaded placement."""
    vocab = text_config(cluster.engine.config)["vocab_size"]
    prompts = random_prompts(vocab, max(args.batch_sizes), args.prompt_tokens, args.seed + 1)
    cluster.stats(reset=True, collect=True)
    cluster.run_batch(cluster.request(prompts, max_tokens=args.record_tokens, seed=0))
    stats = cluster.stats(collect=False)
    own_rows = cluster.engine.dispatcher.dense_ranks is DenseRanks.OWN  # dp: each rank routes its own rows
    counts: Dict[int, List[int]] = {}
    for s in stats if own_rows else stats[:1]:  # else rank 0 sees every routed slot
        for layer, c in s["expert_load"].items():
            counts[int(layer)] = [a + b for a, b in zip(counts.get(int(layer), [0] * len(c)), c)]
    return counts


def placements(counts: Dict[int, List[int]], num_ranks: int, args) -> Dict[str, Optional[Placement]]:
    plans: Dict[str, Optional[Placement]] = {"even": None, "balanced": balanced(counts, num_ranks)}
    if args.duplicates and num_ranks > 1:
        plans[f"balanced+{args.duplicates}d"] = balanced(counts, num_ranks, duplicates=args.duplicates)
    return plans


def run(cluster, args) -> Dict[str, Any]:
    n = cluster.world.size
    cluster.load(args.model, mode=args.mode, layout=args.layout)
    cluster.probe("no_eos")
    counts = recorded_counts(cluster, args)
    plans = placements(counts, n, args)
    if args.save:  # the placements made, for --placement elsewhere (benchmarks/compare --placement N:FILE)
        Path(args.save).mkdir(parents=True, exist_ok=True)
        for name, plan in plans.items():
            if plan is not None:
                plan.save(Path(args.save) / f"{name.replace('+', '-')}.json")
    even = cluster.engine.placement
    if args.rank_memory:  # the mixed-memory case: budgets, with the placement following them
        plans["budgets even"] = "budgets"
        plans["budgets balanced"] = balanced(counts, n, budgets=args.rank_memory)
    vocab = text_config(cluster.engine.config)["vocab_size"]
    trials: Dict[tuple, List[Dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for name, plan in plans.items():
            budgets = args.rank_memory if name.startswith("budgets") else None
            placement = None if plan in (None, "budgets") else plan.to_json()
            cluster.load(args.model, mode=args.mode, layout=args.layout, placement=placement,
                         rank_memory_gb=[b * args.budget_scale for b in budgets] if budgets else None)
            cluster.probe("no_eos")
            used = cluster.engine.placement
            for batch in args.batch_sizes:
                prompts = random_prompts(vocab, batch, args.prompt_tokens, args.seed)
                row = bench_case(cluster, args.mode, prompts, args)
                row.pop("tokens", None)  # b = 1's greedy tokens: not compared here
                row.update(placement=name, predicted_imbalance=imbalance(used, counts),
                           experts_per_rank=[sum(len(used.experts_of(l, r)) for l in used.layers) for r in range(n)])
                trials.setdefault((name, batch), []).append(row)
                print(f"# {name} b={batch}: {row['generation_tps']:.1f} gen tok/s, imbalance "
                      f"{row['imbalance']:.3f}", file=sys.stderr, flush=True)
    rows = []
    for (name, batch), runs in trials.items():
        row = median_row(runs) if len(runs) > 1 else runs[0]
        row["rounds_generation_tps"] = [r["generation_tps"] for r in runs]
        rows.append(row)
    base = {r["batch"]: r["generation_tps"] for r in rows if r["placement"] == "even"}
    for r in rows:
        r["vs_even"] = r["generation_tps"] / base[r["batch"]] if base.get(r["batch"]) else None
    return {"contender": "mlxdist placement", "model": args.model, "ranks": n, "mode": args.mode, "dispatch": args.mode,
            "prompt_tokens": args.prompt_tokens, "generation_tokens": args.generation_tokens,
            "record_tokens": args.record_tokens, "num_trials": args.num_trials, "rounds": args.rounds,
            "even_imbalance_predicted": imbalance(even, counts), "versions": versions(), "results": rows}


def format_table(report: Dict[str, Any]) -> str:
    head = (f"mlxdist placements: {report['model']}, {report['ranks']} ranks, {report['dispatch']}, "
            f"p={report['prompt_tokens']} g={report['generation_tokens']}, median of {report['num_trials']} "
            f"x {report['rounds']} round(s)\n"
            "placement          b   gen t/s  vs even  imbalance  predicted  experts/rank\n")
    lines = [f"{r['placement']:<17} {r['batch']:>3}  {r['generation_tps']:>8.1f}  {r['vs_even']:>7.2f}  "
             f"{r['imbalance']:>9.3f}  {r['predicted_imbalance']:>9.3f}  {'/'.join(map(str, r['experts_per_rank']))}"
             for r in report["results"]]
    return head + "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model folder (default: built-in tiny MoE).")
    parser.add_argument("-p", "--prompt-tokens", type=arg_int(), default=64)
    parser.add_argument("-g", "--generation-tokens", type=arg_int(), default=32)
    parser.add_argument("-b", "--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("-n", "--num-trials", type=arg_int(), default=3)
    parser.add_argument("--rounds", type=arg_int(), default=1, help="Interleaved rounds over the placements.")
    parser.add_argument("--mode", "--dispatch", default="collective", choices=list(modes.MODES))
    parser.add_argument("--layout", choices=("masked", "compact"), default=None)
    parser.add_argument("--duplicates", "--replicas", type=arg_int(), default=1,
                        help="Duplicate slots per rank for the third placement (--replicas: its old name).")
    parser.add_argument("--record-tokens", type=arg_int(), default=32, help="Tokens of the recording generation.")
    parser.add_argument("--rank-memory", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="Also time budgets of these ratios (e.g. 2,1), even and balanced.")
    parser.add_argument("--budget-scale", type=arg_number(), default=1.0,
                        help="GB per unit of --rank-memory (the budgets must hold the rank's experts).")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="Write the placements made from the recorded routing to DIR (one JSON file each).")
    parser.add_argument("--warmup-tokens", type=arg_int(), default=8)
    parser.add_argument("--seed", type=arg_int(), default=0)
    parser.add_argument("--json", action="store_true", help="One JSON object on stdout.")
    args = parser.parse_args(argv)
    args.no_link, args.expert_split = False, "whole"  # what bench_case reads
    if args.num_trials < 1 or args.rounds < 1 or min(args.batch_sizes) < 1:
        parser.error("-n, --rounds and every batch size must be at least 1")
    return args


def main(argv=None) -> None:
    run_on_every_rank(run, format_table, parse_args(argv))


if __name__ == "__main__":
    main()
