"""``python -m mlxdist.bench.capacity`` under mpirun: generation tok/s and the
paging hit rate against ``--expert-capacity``, one load per capacity.

    launch/mpirun -np 2 python -m mlxdist.bench.capacity --model DIR -c 1,2,4,8,16 [-b 8 -p 32 -g 32 --json]
    python -m mlxdist.bench.capacity --plot curve.png np2.json np4.json   # the curves of saved --json reports

Each capacity: a warm-up generation, then the median of ``-n`` timed batch
generations of ``-b`` random prompts, then the paging counters of one more
(every rank's hits, misses, bytes and seconds paged in, summed). The first
row is the capacity that holds every owned expert (no paging), the reference.
"""

import argparse
import json
import statistics
import sys
from typing import Any, Dict, List, Optional

from mlxdist.bench.harness import random_prompts
from mlxdist.inputs.digits import arg_int
from mlxdist.model.checkpoint import text_config


def measure(cluster, model: str, capacity: Optional[int], args) -> Dict[str, Any]:
    cluster.load(model, mode=args.mode, layout="compact", expert_capacity=capacity)
    vocab = text_config(cluster.engine.config)["vocab_size"]
    prompts = random_prompts(vocab, args.batch, args.prompt_tokens, args.seed)
    cluster.run_batch(cluster.request(prompts, max_tokens=min(8, args.generation_tokens)))
    tps = []
    for _ in range(args.num_trials):
        results = cluster.run_batch(cluster.request(prompts, max_tokens=args.generation_tokens))
        tps.append(results[0].stats["generation_tps"])
    cluster.stats(reset=True)
    cluster.run_batch(cluster.request(prompts, max_tokens=args.generation_tokens))
    stats = cluster.stats(reset=True)
    paging = [s["paging"] for s in stats if s.get("paging")]
    hits, misses = sum(p["hits"] for p in paging), sum(p["misses"] for p in paging)
    return {
        "capacity": capacity, "generation_tps": statistics.median(tps), "trials": tps,
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "bytes_paged_in_per_token": sum(p["bytes_paged_in"] for p in paging) / (args.batch * args.generation_tokens),
        "page_in_seconds": sum(p["page_in_seconds"] for p in paging),
        "expert_gb_per_rank": [s["weights_gb"]["expert"] for s in stats],
    }


def plot(reports: List[Dict[str, Any]], path: str) -> None:
    """tok/s and hit rate against capacity, one line per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for report in reports:
        rows = [r for r in report["rows"] if r["capacity"] is not None]
        label = f"N = {report['ranks']}"
        line = a.plot([r["capacity"] for r in rows], [r["generation_tps"] for r in rows], marker="o", label=label)
        a.axhline(report["rows"][0]["generation_tps"], color=line[0].get_color(), linestyle=":", linewidth=1)
        b.plot([r["capacity"] for r in rows], [r["hit_rate"] for r in rows], marker="o", label=label)
    a.set(xlabel="--expert-capacity (experts resident per layer and rank)", ylabel="generation tok/s",
          title="tok/s (dotted: every owned expert resident)")
    b.set(xlabel="--expert-capacity", ylabel="hit rate", title="paging hit rate", ylim=(0, 1.05))
    for ax in (a, b):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    import mlxdist

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--plot"]:
        plot([json.loads(open(f).read().splitlines()[-1]) for f in argv[2:]], argv[1])
        return 0

    p = argparse.ArgumentParser(prog="python -m mlxdist.bench.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("-c", "--capacities", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--mode", "--dispatch", default="collective", choices=("collective", "p2p", "dp", "auto"))
    p.add_argument("-b", "--batch", type=arg_int(), default=8)
    p.add_argument("-p", "--prompt-tokens", type=arg_int(), default=32)
    p.add_argument("-g", "--generation-tokens", type=arg_int(), default=32)
    p.add_argument("-n", "--num-trials", type=arg_int(), default=2)
    p.add_argument("--seed", type=arg_int(), default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with mlxdist.init(timeout=600) as cluster:
        rows = [measure(cluster, args.model, None, args)]
        rows += [measure(cluster, args.model, c, args) for c in args.capacities]
        report = {"model": args.model, "ranks": cluster.world.size, "mode": args.mode, "dispatch": args.mode, "batch": args.batch,
                  "prompt_tokens": args.prompt_tokens, "generation_tokens": args.generation_tokens, "rows": rows}
    if args.json:
        print(json.dumps(report))
    else:
        for r in rows:
            print(f"capacity {r['capacity'] or 'all':>4}: {r['generation_tps']:7.1f} tok/s, hit rate "
                  f"{r['hit_rate']:.2f}, {r['bytes_paged_in_per_token'] / 1e6:.2f} MB paged in per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
