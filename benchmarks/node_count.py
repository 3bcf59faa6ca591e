"""Graph nodes in one decode step: mlx-lm alone at batch b (one process), or
mlxdist's dp mode at batch b over the ranks (under mpirun), by primitive.

On GPUs a decode step is bound by the host, which pays for every node (build
in Python, then MLX's evaluation and kernel capture: benchmarks/gpu/host.sh),
so the nodes a mode adds per MoE layer predict its cost there. Counting needs
no GPU: the graph is the same on the CPU (``mx.export_to_dot`` of the step's
outputs, before evaluation).

    python benchmarks/node_count.py MODEL 4 alone [--grouped]
    python benchmarks/node_count.py MODEL 32 one    # mlxdist's batches, collective
    mpirun -np 2 python benchmarks/node_count.py MODEL 8 dp [--expert-split width] [--layout masked]
"""

import argparse
import collections
import json
import os
import re
import tempfile

import mlx.core as mx

_LABEL = re.compile(r'label ="([^"]+)"')


def count_nodes(*arrays: mx.array) -> collections.Counter:
    """Primitives in the unevaluated graph behind ``arrays``, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "g.dot")
        mx.export_to_dot(path, *arrays)
        return collections.Counter(_LABEL.findall(open(path).read()))


def _counting(run) -> collections.Counter:
    """The nodes of the last step ``run()`` evaluates with ``mx.async_eval``,
    and of what is started with it (``mlxdist/batch.py`` starts each step's
    log-probability picks apart): the last two calls, where the last is small."""
    steps, real = [], mx.async_eval

    def counted(*arrays):
        steps.append(count_nodes(*arrays))
        real(*arrays)

    mx.async_eval = counted
    try:
        run()
    finally:
        mx.async_eval = real
    last = steps[-1]
    if len(steps) > 1 and sum(last.values()) < sum(steps[-2].values()) / 10:
        return steps[-2] + last
    return last


def alone(path: str, batch: int) -> collections.Counter:
    """mlx-lm's own batched generation (batch_generate, as the replicas run)."""
    from mlx_lm import batch_generate, load

    model, tokenizer = load(path)
    prompts = [tokenizer.encode(f"prompt number {i} " * 4) for i in range(batch)]
    return _counting(lambda: batch_generate(model, tokenizer, prompts, max_tokens=4))


def one_rank(path: str, batch: int) -> collections.Counter:
    """mlxdist's batches under ``collective`` (``mlxdist/batch.py``)."""
    import mlxdist

    with mlxdist.init() as cluster:
        cluster.load(path, dispatch="collective")
        prompts = [f"prompt number {i} " * 4 for i in range(batch)]
        return _counting(lambda: cluster.generate_batch(prompts, max_tokens=4))


def data_parallel(path: str, batch: int, layout: str, expert_split: str) -> collections.Counter:
    import mlxdist

    with mlxdist.init() as cluster:
        cluster.load(path, dispatch="dp", layout=layout, expert_split=expert_split)
        prompts = [f"prompt number {i} " * 4 for i in range(batch)]
        return _counting(lambda: cluster.generate_batch(prompts, max_tokens=4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("batch", type=int)
    parser.add_argument("mode", choices=("alone", "one", "dp"))
    parser.add_argument("--grouped", action="store_true",
                        help="alone: mlx-lm's expert calls grouped by expert (mlxdist.grouped, as on GPUs)")
    parser.add_argument("--layout", default="masked")
    parser.add_argument("--expert-split", default="whole")
    args = parser.parse_args()
    if args.grouped:
        from grouped_single import grouping  # this script's folder

        grouping(True)
    if args.mode == "alone":
        nodes, name = alone(args.model, args.batch), "mlx-lm alone" + (" grouped" if args.grouped else "")
    elif args.mode == "one":
        nodes, name = one_rank(args.model, args.batch), "mlxdist collective"
    else:
        nodes = data_parallel(args.model, args.batch, args.layout, args.expert_split)
        name = f"mlxdist dp ({args.layout}, experts {args.expert_split})"
        if mx.distributed.init().rank() != 0:
            return
    print(json.dumps({"contender": name, "batch": args.batch, "nodes": sum(nodes.values()),
                      "by_primitive": dict(nodes.most_common())}), flush=True)


if __name__ == "__main__":
    main()
