"""Under mpirun: for each layout in turn, one load and many generate calls
of varied lengths, each followed by a stats call (the control plane speaks
mpi4py right after MLX's collectives ran on their worker thread); prints,
per layout, each call's tokens and every rank's resident memory after the
first 10 calls and after the last.

    python soak.py CKPT LAYOUT:CALLS [LAYOUT:CALLS ...]
"""

import json
import sys

import mlxdist

ckpt, runs = sys.argv[1], [arg.split(":") for arg in sys.argv[2:]]
PROMPTS = [f"Soak prompt {i}: " + "experts " * (i * 7 % 23) for i in range(10)]
out = {"prompts": PROMPTS}
with mlxdist.init() as cluster:
    for layout, calls in runs:
        cluster.load(ckpt, mode="collective", layout=layout)
        run = out[layout] = {"calls": [], "rss_after_10": None}
        for i in range(int(calls)):
            prompt, max_tokens = PROMPTS[i % 10], 1 + (i * 5) % 16
            run["calls"].append([i % 10, max_tokens, cluster.generate(prompt, max_tokens=max_tokens).tokens])
            rss = [s["rss_gb"] for s in cluster.stats()]
            if i == 9:
                run["rss_after_10"] = rss
        run["rss_after_all"] = [s["rss_gb"] for s in cluster.stats()]
print(json.dumps(out))
