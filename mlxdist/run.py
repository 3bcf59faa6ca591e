"""Entry point: ``mpirun -np N python -m mlxdist.run --model M --prompt P``.

Rank 0 runs the command loop (LOAD, then GENERATE per prompt, SHUTDOWN)
through ``Cluster``; every other rank serves until SHUTDOWN. Errors in the
user's input end the job with one line on rank 0 and a non-zero exit on every
rank; an unexpected error aborts the whole MPI job.
"""

import argparse
import json
import os
import sys
from typing import Iterator, List, Optional

from .api import Cluster
from .engine import SamplingParams, UserError
from .mpi import init_world, run_or_abort
from .placement import PlacementError
from .server import Server
from .watchdog import DEFAULT_TIMEOUT, start_watchdog


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or hub id (default: a small built-in random MoE)")
    p.add_argument("--prompt", help="one prompt; without it, rank 0 reads one prompt per line from stdin")
    p.add_argument("--jobs", help="JSONL job file (one {id, prompt|messages, ...} per line)")
    p.add_argument("--out", help="JSONL results file for --jobs (appended; a rerun resumes)")
    p.add_argument("--batch-size", type=int, default=8, help="jobs decoded together with --jobs")
    p.add_argument("--max-tokens", "-m", type=int, default=64)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--dispatch", choices=["collective", "p2p", "collective-tp"], default="collective",
                   help="collective-tp: attention and dense layers tensor parallel (mlx-lm's shard()); not bit-exact")
    p.add_argument("--placement", help="placement JSON file (default: experts spread evenly)")
    p.add_argument("--save-placement", help="write the placement used to this JSON file")
    p.add_argument("--no-rank0-experts", action="store_true", help="rank 0 holds no experts")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds without progress before a generation is declared hung (default %(default)s)")
    p.add_argument("--logprobs-out", help="save each step's log-probabilities (.npy) for checks")
    return p


def sampling_args(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        prefill_step_size=args.prefill_step_size,
    )


def fail(message: str) -> None:
    print(f"mlxdist: error: {message}", file=sys.stderr, flush=True)


def _stdin():
    """Rank 0's standard input: the FIFO ``launch/mpirun`` hands it, where
    set, since Open MPI 5 forwards stdin lines to rank 0 but never their EOF
    (with plain mpirun, end the input with a line reading /exit)."""
    path = os.environ.get("MLXDIST_STDIN")
    return open(path) if path else sys.stdin


def _prompts(args) -> Iterator[str]:
    """--prompt, or one prompt per line of stdin until EOF or /exit."""
    if args.prompt is not None:
        yield args.prompt
        return
    for line in _stdin():
        line = line.rstrip("\n")
        if line.strip() == "/exit":
            return
        if line.strip():
            yield line


def _summary(stats: dict, tokens: int) -> str:
    peaks = ", ".join(f"{p:.3f}" for p in stats["peak_memory_gb"])
    return (
        f"prompt: {stats.get('prompt_tokens', 0)} tokens, {stats.get('prompt_tps', 0.0):.1f} tok/s | "
        f"generation: {tokens} tokens, {stats.get('generation_tps', 0.0):.1f} tok/s | "
        f"peak memory (GB) per rank: [{peaks}]"
    )


def _run_prompt(cluster: Cluster, args, text: str, logprobs: List) -> None:
    kwargs = {"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text}
    stats: dict = {}
    tokens, pieces = [], []
    request = cluster._request([cluster.encode(**kwargs)], sampling_args(args))
    for piece in cluster._stream(request, stats):
        tokens.append(piece.token)
        pieces.append(piece.text)
        if args.logprobs_out:
            logprobs.append(piece.logprobs)
        if not args.json:
            print(piece.text, end="", flush=True)
    if args.json:
        engine = cluster.engine
        print(json.dumps({
            "text": "".join(pieces),
            "tokens": tokens,
            "prompt_tokens": stats.get("prompt_tokens", 0),
            "prompt_tps": stats.get("prompt_tps", 0.0),
            "generation_tps": stats.get("generation_tps", 0.0),
            "finish_reason": stats.get("finish_reason"),
            "peak_memory_gb": stats["peak_memory_gb"],
            "weights_gb": [{k.replace("_bytes", ""): v / 1e9 for k, v in m.items()} for m in engine.memory_by_rank],
            "dispatch": engine.dispatch,
            "num_ranks": cluster.world.size,
        }), flush=True)
    else:
        print(flush=True)
        print(_summary(stats, len(tokens)), file=sys.stderr, flush=True)


def command_loop(cluster: Cluster, args) -> int:
    """Rank 0: LOAD, then GENERATE each prompt (or the job file)."""
    try:
        SamplingParams(**{**sampling_args(args), "seed": 0}).validate()
        cluster.load(args.model, args.dispatch, args.placement, not args.no_rank0_experts)
    except (UserError, PlacementError) as e:
        fail(str(e))
        return 1
    if args.save_placement:
        cluster.engine.placement.save(args.save_placement)
    if args.jobs:
        from .jobs import run_jobs

        return run_jobs(cluster, args.jobs, args.out, sampling_args(args), args.batch_size)
    logprobs: List = []
    for text in _prompts(args):
        try:
            _run_prompt(cluster, args, text, logprobs)
        except UserError as e:
            fail(str(e))
            if args.prompt is not None:
                return 1
    if args.logprobs_out:
        import numpy as np

        np.save(args.logprobs_out, np.stack([np.array(l) for l in logprobs]))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs and not args.out:
        build_parser().error("--jobs needs --out")
    try:
        world = init_world()
    except RuntimeError as e:
        fail(str(e))
        return 1
    start_watchdog(world, args.timeout)
    if not world.is_root:
        return run_or_abort(world, Server(world).serve)
    cluster = Cluster(world)
    code = run_or_abort(world, command_loop, cluster, args)
    cluster.shutdown(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
