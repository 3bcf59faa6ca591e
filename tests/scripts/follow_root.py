"""Under mpirun: one checkpoint, greedy, in every way a generation samples
on several ranks at once; rank 0 writes each one's tokens.

    python follow_root.py OUT_JSON CKPT PROMPT MAX_TOKENS

Keys: collective, p2p, auto (one prompt each), collective-batch (two prompts),
draft (collective, the checkpoint as its own draft model, 3 drafted tokens),
lookup (collective, prompt lookup of 2-grams).
"""

import json
import sys

import mlxdist


def main(out: str, path: str, prompt: str, max_tokens: str) -> None:
    n = int(max_tokens)
    tokens = {}
    with mlxdist.init() as cluster:
        for dispatch in ("collective", "p2p", "auto"):
            cluster.load(path, mode=dispatch)
            ids = cluster.encode(prompt)
            tokens[dispatch] = cluster.generate(prompt, max_tokens=n).tokens
            if dispatch == "collective":
                batch = cluster.run_batch(cluster.request([ids, ids[:-2]], max_tokens=n))
                tokens["collective-batch"] = [r.tokens for r in batch]
                tokens["lookup"] = cluster.generate(prompt, max_tokens=n, prompt_lookup_ngram=2,
                                                    num_draft_tokens=3).tokens
        cluster.load(path, mode="collective", draft_model=path)
        tokens["draft"] = cluster.generate(prompt, max_tokens=n, num_draft_tokens=3).tokens
        if cluster.world.is_root:
            with open(out, "w") as f:
                json.dump(tokens, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
