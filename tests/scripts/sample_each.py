"""Under mpirun: one batch of copies of one prompt, sampled at temperature 1
with a seed, under each dispatch mode given; prints each mode's tokens as JSON.

    python sample_each.py CKPT N_COPIES MAX_TOKENS SEED DISPATCH [DISPATCH ...]
"""

import json
import sys

import mlxdist

if __name__ == "__main__":
    path, copies, max_tokens, seed, *dispatches = sys.argv[1:]
    out = {}
    with mlxdist.init() as cluster:
        for dispatch in dispatches:
            cluster.load(path, mode=dispatch)
            results = cluster.generate_batch(["the weather today"] * int(copies), max_tokens=int(max_tokens),
                                             temp=1.0, seed=int(seed))
            out[dispatch] = [r.tokens for r in results]
    print(json.dumps(out))
