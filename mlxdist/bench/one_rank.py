"""``python -m mlxdist.bench one-rank``: mlxdist on one rank against mlx-lm
alone, in one process, on one checkpoint, interleaved round by round (the
fairest one-rank comparison: one launch, one warm machine for both).

Per batch size: mlx-lm's ``stream_generate`` (b = 1) or ``batch_generate``
(as the benchmark's mlx-lm contender calls it), the same asking for
log-probabilities (b > 1), and mlxdist's ``Cluster.stream`` / ``run_batch``
with ``--mode collective``. EOS is ignored on both sides, so every
trial generates its full ``-g`` tokens. Prints one JSON line per batch size:
each contender's median generation tok/s over the rounds, every trial, each
round's mlxdist / mlx-lm (``round_ratios``) and their median
(``mlxdist_over_mlx_lm``: rounds run back to back, so a round's two figures
share the machine's state, which the medians of each side alone would not).

    python -m mlxdist.bench one-rank MODEL [-b 1,8,32] [-p 128] [-g 32] [-n 5]
"""

import argparse
import json
import statistics
from typing import Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import batch_generate, stream_generate

import mlxdist
from mlxdist.bench import probes  # noqa: F401  (registers no_eos)
from mlxdist.compat import never_stop_at_eos
from mlxdist.inputs.digits import arg_int


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench one-rank", description=__doc__.splitlines()[0])
    p.add_argument("model", help="model folder or hub id")
    p.add_argument("-b", "--batch-sizes", default="1,8,32", help="comma-separated (default %(default)s)")
    p.add_argument("-p", "--prompt-tokens", type=arg_int(), default=128, help="prompt tokens (default %(default)s)")
    p.add_argument("-g", "--generation-tokens", type=arg_int(), default=32, help="tokens generated (default %(default)s)")
    p.add_argument("-n", "--rounds", type=arg_int(), default=5, help="interleaved rounds (default %(default)s)")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"-b takes comma-separated integers, not {args.batch_sizes!r}")
    if min(args.batch_sizes) < 1 or args.rounds < 1 or args.prompt_tokens < 1 or args.generation_tokens < 1:
        p.error("-b, -p, -g and -n must be at least 1")
    return args


def prompts_of(batch: int, tokens: int) -> List[List[int]]:
    """Fixed prompts (no tokenizer involved): ``batch`` sequences of ``tokens`` ids."""
    return [[(7 * i + 13 * j) % 1000 + 10 for j in range(tokens)] for i in range(batch)]


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    model, tokenizer = load(args.model)
    never_stop_at_eos(tokenizer)  # as mlx_lm.benchmark and the other contenders
    with mlxdist.init() as cluster:
        cluster.load(args.model, mode="collective")
        cluster.probe("no_eos")
        for b in args.batch_sizes:
            prompts = prompts_of(b, args.prompt_tokens)

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
                    stats: Dict = {}
                    for _ in cluster.stream(request, stats):
                        pass
                    return stats["generation_tps"]
                return cluster.run_batch(request)[0].stats["generation_tps"]

            runs: Dict[str, Callable[[int], float]] = {"mlx-lm": lambda g: mlx_lm(False, g), "mlxdist": mlxdist_one}
            if b > 1:
                runs["mlx-lm with logprobs"] = lambda g: mlx_lm(True, g)
            for run in runs.values():  # warm-up
                run(4)
            trials: Dict[str, List[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    trials[name].append(run(args.generation_tokens))
            medians = {name: statistics.median(v) for name, v in trials.items()}
            ratios = [ours / theirs for ours, theirs in zip(trials["mlxdist"], trials["mlx-lm"])]
            print(json.dumps({"batch": b, **medians, "mlxdist_over_mlx_lm": statistics.median(ratios),
                              "round_ratios": ratios, "trials": trials}), flush=True)


if __name__ == "__main__":
    main()
