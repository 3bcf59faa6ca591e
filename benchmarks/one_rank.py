"""Where mlxdist on one rank loses to mlx-lm on a GPU: in one process, on one
checkpoint, interleaved, generation tok/s of mlx-lm's ``batch_generate`` as the
benchmark's mlx-lm contender calls it, the same asking for log-probabilities
(as mlxdist's engine did before ``mlxdist/batch.py``), the same with its expert
calls grouped by expert (``mlxdist.grouped``, as mlxdist's are on GPUs from two
slots per expert), and mlxdist's own batch (``run_batch``) on one rank;
at b = 1, ``stream_generate`` against ``Cluster.stream``. Both hold the same
graph per step (``benchmarks/node_count.py``), so a gap is host time.

    python benchmarks/one_rank.py MODEL [-b 1,32] [-p 128] [-g 32] [-n 2]
"""

import json

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate, stream_generate

import mlxdist
from grouped_single import arguments, grouping  # this script's folder


def main():
    a = arguments("1,32")
    model, tokenizer = load(a.model)
    with mlxdist.init() as cluster:
        cluster.load(a.model, dispatch="collective")
        for b in map(int, a.b.split(",")):
            prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(a.p)] for i in range(b)]

            def mlx_lm(logprobs: bool, g: int) -> float:
                if b == 1:
                    for r in stream_generate(model, tokenizer, mx.array(prompts[0]), max_tokens=g):
                        pass
                    return r.generation_tps
                return batch_generate(model, tokenizer, prompts, max_tokens=g, completion_batch_size=b,
                                      prefill_batch_size=b, return_logprobs=logprobs).stats.generation_tps

            def mlxdist_one(g: int) -> float:
                request = cluster.request(prompts, max_tokens=g, seed=0)
                if b == 1:
                    stats = {}
                    for _ in cluster.stream(request, stats):
                        pass
                    return stats["generation_tps"]
                return cluster.run_batch(request)[0].stats["generation_tps"]

            def grouped(call):
                grouping(True)
                try:
                    return call()
                finally:
                    grouping(False)

            runs = {"mlx-lm": lambda g: mlx_lm(False, g), "mlxdist np=1": mlxdist_one}
            if b > 1:
                runs["mlx-lm with logprobs"] = lambda g: mlx_lm(True, g)
                runs["mlx-lm grouped"] = lambda g: grouped(lambda: mlx_lm(False, g))
            for run in runs.values():  # warm-up
                run(4)
            tps = {name: [] for name in runs}
            for _ in range(a.n):
                for name, run in runs.items():
                    tps[name].append(run(a.g))
            print(json.dumps({"batch": b, **{k: sorted(v)[len(v) // 2] for k, v in tps.items()}, "trials": tps}),
                  flush=True)


if __name__ == "__main__":
    main()
