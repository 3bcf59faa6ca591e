"""Under mpirun (with or without ``--survive``): p2p generations on one
checkpoint, with an optional loss between them; prints every result's tokens,
the lost ranks, the stats' ranks and the prompts (with their max_tokens) as
JSON.

    python survive.py CKPT KILL_BETWEEN [CAPACITY [PLACEMENT [PLACEMENT ...]]]

KILL_BETWEEN: a rank that rank 0 kills (SIGKILL) between the first stream
and the rest, or -1. A test fault (MLXDIST_FAULT) may kill another rank
during the first stream. PLACEMENT: a placement file, or "even"; several
run the whole sequence once each, in turn on the same job, one JSON line
each.
"""

import json
import os
import signal
import sys
import time

import mlxdist
from mlxdist.bench import survival  # noqa: F401 (registers the "process" probe on every rank)

PROMPTS = {"first": ["a loss is coming", 24], "second": ["and then another", 16],
           "batch": [[f"prompt {i} " * (i + 1), 12] for i in range(5)]}


def run(cluster, path: str, kill_between: int, capacity, placement) -> dict:
    """Load, stream, (kill a rank), stream and batch: every result and what the ranks report."""
    cluster.load(path, mode="p2p", expert_capacity=capacity, placement=placement)
    processes = {p["rank"]: p["pid"] for p in cluster.probe("process")}
    expert_gb_before = cluster.stats()[0]["weights_gb"]["expert"]
    (text, max_tokens), batch_max_tokens = PROMPTS["first"], PROMPTS["batch"][0][1]
    first = [p.token for p in cluster.stream(cluster.request([cluster.encode(text)], max_tokens=max_tokens))]
    if kill_between >= 0:
        os.kill(processes[kill_between], signal.SIGKILL)
        time.sleep(0.5)
    text, max_tokens = PROMPTS["second"]
    second = [p.token for p in cluster.stream(cluster.request([cluster.encode(text)], max_tokens=max_tokens))]
    batch = cluster.run_batch(cluster.request([cluster.encode(text) for text, _ in PROMPTS["batch"]],
                                              max_tokens=batch_max_tokens))
    stats = cluster.stats()
    return {"first": first, "second": second, "batch": [r.tokens for r in batch], "lost": cluster.world.lost,
            "stats_ranks": [s["rank"] for s in stats],
            "rank0_expert_gb": [expert_gb_before, stats[0]["weights_gb"]["expert"]], "prompts": PROMPTS}


path, kill_between, *rest = sys.argv[1:]
capacity = int(rest[0]) if rest and int(rest[0]) > 0 else None
placements = [None if p == "even" else p for p in rest[1:]] or [None]  # placement files (replicas, ...)
with mlxdist.init() as cluster:
    outs = [run(cluster, path, int(kill_between), capacity, placement) for placement in placements]
for out in outs:
    print(json.dumps(out))
