"""Under mpirun (with or without ``--survive``): p2p generations on one
checkpoint, with an optional loss between them; prints every result's tokens,
the lost ranks, the stats' ranks and the prompts (with their max_tokens) as
JSON.

    python survive.py CKPT KILL_BETWEEN [CAPACITY [PLACEMENT]]

KILL_BETWEEN: a rank that rank 0 kills (SIGKILL) between the first stream
and the rest, or -1. A test fault (MLXDIST_FAULT) may kill another rank
during the first stream.
"""

import json
import os
import signal
import sys
import time

import mlxdist
from mlxdist.bench import survival  # noqa: F401 (registers the "process" probe on every rank)

path, kill_between, *rest = sys.argv[1:]
capacity = int(rest[0]) if rest and int(rest[0]) > 0 else None
placement = rest[1] if len(rest) > 1 else None  # a placement file (replicas, ...)
PROMPTS = {"first": ["a loss is coming", 24], "second": ["and then another", 16],
           "batch": [[f"prompt {i} " * (i + 1), 12] for i in range(5)]}
with mlxdist.init() as cluster:
    cluster.load(path, dispatch="p2p", expert_capacity=capacity, placement=placement)
    processes = {p["rank"]: p["pid"] for p in cluster.probe("process")}
    expert_gb_before = cluster.stats()[0]["weights_gb"]["expert"]
    (text, max_tokens), batch_max_tokens = PROMPTS["first"], PROMPTS["batch"][0][1]
    first = [p.token for p in cluster.stream(cluster.request([cluster.encode(text)], max_tokens=max_tokens))]
    if int(kill_between) >= 0:
        os.kill(processes[int(kill_between)], signal.SIGKILL)
        time.sleep(0.5)
    text, max_tokens = PROMPTS["second"]
    second = [p.token for p in cluster.stream(cluster.request([cluster.encode(text)], max_tokens=max_tokens))]
    batch = cluster.run_batch(cluster.request([cluster.encode(text) for text, _ in PROMPTS["batch"]],
                                              max_tokens=batch_max_tokens))
    stats = cluster.stats()
    out = {"first": first, "second": second, "batch": [r.tokens for r in batch], "lost": cluster.world.lost,
           "stats_ranks": [s["rank"] for s in stats],
           "rank0_expert_gb": [expert_gb_before, stats[0]["weights_gb"]["expert"]], "prompts": PROMPTS}
print(json.dumps(out))
