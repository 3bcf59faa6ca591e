"""Under mpirun: load each checkpoint in turn and generate one batch,
printing every sequence's tokens and sampled-token log-probabilities as JSON.

    python batch_each.py DISPATCH[:SPLIT[:REPLICATE]] LAYOUT MAX_TOKENS COMPLETION_BATCH PREFILL_STEP CKPT [CKPT ...]

MAX_TOKENS is a comma-separated list, one per prompt (PROMPTS below);
several lists joined by "/" run one batch after another on the same load
(the JSON then holds a list of results per checkpoint); COMPLETION_BATCH 0
decodes every prompt at once. ``run`` does the same on a cluster already
started (tests/scripts/several.py). MLXDIST_BACKEND picks MLX's transport
("mpi" or "nccl"; default: nccl on CUDA, else mpi).
"""

import json
import os
import sys

import mlxdist

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Experts are routed by a gate",
    "Hello",
    "A mixture of experts model sends each token to a few experts chosen by a small router",
    "Numbers such as 1, 2, 3",
]


def run(cluster, args) -> dict:
    """batch_each.py's work for ``args`` (its command line) on ``cluster``:
    checkpoint -> its result (a list of them for several batches)."""
    dispatch, layout, max_tokens, completion, prefill_step, *paths = map(str, args)
    dispatch, _, split = dispatch.partition(":")  # e.g. dp:width, experts cut in width; auto::never
    split, _, replicate = split.partition(":")
    batches = [[int(m) for m in group.split(",")] for group in max_tokens.split("/")]
    out = {}
    for path in paths:
        cluster.load(path, mode=dispatch, layout=layout, expert_split=split or "whole",
                     replicate=replicate or "auto")
        runs = []
        for lengths in batches:
            request = cluster.request([cluster.encode(p) for p in PROMPTS[: len(lengths)]], max_tokens=lengths,
                                      completion_batch_size=int(completion) or None,
                                      prefill_step_size=int(prefill_step))
            results = cluster.run_batch(request)
            runs.append({
                "tokens": [r.tokens for r in results],
                "logprobs": [r.logprobs for r in results],
                "strategy": cluster.engine.mode_in_use,
                "kv_cache_gb": results[0].stats.get("kv_cache_gb"),
                "dense_bytes": [m["dense_bytes"] for m in cluster.engine.memory_by_rank],
                "expert_bytes": [m["expert_bytes"] for m in cluster.engine.memory_by_rank],
                "loaded": list(cluster.engine.dispatchers),
            })
        out[path] = runs if len(batches) > 1 else runs[0]
    return out


if __name__ == "__main__":
    with mlxdist.init(timeout=900, backend=os.environ.get("MLXDIST_BACKEND")) as cluster:  # a first CUDA run compiles for minutes
        print(json.dumps(run(cluster, sys.argv[1:])))
