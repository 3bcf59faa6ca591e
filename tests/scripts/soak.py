"""Under mpirun: many generate calls of varied lengths in one cluster, each
followed by a stats call (the control plane speaks mpi4py right after MLX's
collectives ran on their worker thread); prints each call's tokens and every
rank's resident memory after the first 10 calls and after the last.

    python soak.py CKPT CALLS [LAYOUT]
"""

import json
import sys

import mlxdist

ckpt, calls = sys.argv[1], int(sys.argv[2])
layout = sys.argv[3] if len(sys.argv) > 3 else "masked"
PROMPTS = [f"Soak prompt {i}: " + "experts " * (i * 7 % 23) for i in range(10)]
out = {"calls": [], "rss_after_10": None}
with mlxdist.init() as cluster:
    cluster.load(ckpt, dispatch="collective", layout=layout)
    for i in range(calls):
        prompt, max_tokens = PROMPTS[i % 10], 1 + (i * 5) % 16
        out["calls"].append([i % 10, max_tokens, cluster.generate(prompt, max_tokens=max_tokens).tokens])
        rss = [s["rss_gb"] for s in cluster.stats()]
        if i == 9:
            out["rss_after_10"] = rss
    out["rss_after_all"] = [s["rss_gb"] for s in cluster.stats()]
    out["prompts"] = PROMPTS
print(json.dumps(out))
