"""mlx-lm alone with its expert calls as they are and grouped by expert
(``mlxdist.grouped``), in one process on one checkpoint: prompt and
generation tok/s of ``batch_generate`` and whether the tokens are equal.

    python benchmarks/grouped_single.py MODEL [-b 8,32,64] [-p 128] [-g 32] [-n 2]
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxdist.model.grouped import call_grouped, groups

STOCK = {cls: cls.__call__ for cls in (SwitchGLU, SwitchMLP)}


def grouping(on: bool) -> None:
    for cls, call in STOCK.items():
        cls.__call__ = (lambda self, x, inds, _call=call: call_grouped(self, x, inds) if groups(self, inds)
                        else _call(self, x, inds)) if on else call


def run(model, tokenizer, prompts, gen):
    tic = time.perf_counter()
    r = batch_generate(model, tokenizer, prompts, max_tokens=gen, completion_batch_size=len(prompts),
                       prefill_batch_size=len(prompts), return_token_ids=True)
    return {"prompt_tps": r.stats.prompt_tps, "generation_tps": r.stats.generation_tps,
            "wall_s": time.perf_counter() - tic}, r.token_ids


def arguments(batches: str) -> argparse.Namespace:
    """MODEL, -b batch sizes (default ``batches``), -p prompt tokens, -g generated
    tokens, -n rounds: this script's and ``one_rank.py``'s command line."""
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("-b", default=batches)
    p.add_argument("-p", type=int, default=128)
    p.add_argument("-g", type=int, default=32)
    p.add_argument("-n", type=int, default=2)
    return p.parse_args()


def main():
    a = arguments("8,32,64")
    model, tokenizer = load(a.model)
    for b in map(int, a.b.split(",")):
        prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(a.p)] for i in range(b)]
        for on in (False, True):  # warm-up: MLX compiles each kernel shape once
            grouping(on)
            run(model, tokenizer, prompts, 4)
        rows = {False: [], True: []}
        tokens = {}
        for _ in range(a.n):
            for on in (False, True):
                grouping(on)
                stats, tokens[on] = run(model, tokenizer, prompts, a.g)
                rows[on].append(stats)
        grouping(False)
        med = {on: {k: sorted(r[k] for r in rows[on])[len(rows[on]) // 2] for k in rows[on][0]} for on in rows}
        print(json.dumps({"batch": b, "prompt": a.p, "stock": med[False], "grouped": med[True],
                          "prompt_x": round(med[True]["prompt_tps"] / med[False]["prompt_tps"], 3),
                          "generation_x": round(med[True]["generation_tps"] / med[False]["generation_tps"], 3),
                          "tokens_equal": tokens[False] == tokens[True]}), flush=True)


if __name__ == "__main__":
    main()
