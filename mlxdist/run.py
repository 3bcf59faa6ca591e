"""Entry point: ``mpirun -np N python -m mlxdist.run --model M --prompt P``.

Rank 0 runs the command loop (LOAD, then GENERATE per prompt, SHUTDOWN) and
broadcasts each command; every other rank serves until SHUTDOWN. Errors in
the user's input end the job with one line on rank 0 and a non-zero exit on
every rank; an unexpected error aborts the whole MPI job.
"""

import argparse
import json
import os
import random
import sys
from typing import Iterator, List, Optional

import mlx.core as mx

from . import commands
from .commands import Command, ProtocolError
from .engine import Engine, SamplingParams, UserError, load_engine
from .mpi import World, abort, allgather_json, init_world
from .placement import Placement, PlacementError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxdist.run", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder or hub id (default: a small built-in random MoE)")
    p.add_argument("--prompt", help="one prompt; without it, rank 0 reads one prompt per line from stdin")
    p.add_argument("--max-tokens", "-m", type=int, default=64)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--dispatch", choices=["collective", "p2p"], default="collective")
    p.add_argument("--placement", help="placement JSON file (default: experts spread evenly)")
    p.add_argument("--save-placement", help="write the placement used to this JSON file")
    p.add_argument("--no-rank0-experts", action="store_true", help="rank 0 holds no experts")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--logprobs-out", help="save each step's log-probabilities (.npy) for checks")
    return p


def _fail(message: str) -> None:
    print(f"mlxdist: error: {message}", file=sys.stderr, flush=True)


def _load(world: World, command: Command) -> Optional[Engine]:
    """LOAD on every rank; all ranks learn whether any failed."""
    engine, error = None, None
    try:
        args = command.args
        engine = load_engine(
            world, args["model"], args["dispatch"], args.get("placement"), args.get("rank0_experts", True)
        )
    except (UserError, PlacementError, ValueError, OSError) as e:
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    except Exception as e:  # a corrupt file fails deep inside mlx / tokenizers
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    reports = allgather_json(world, {"error": error, "memory": engine.memory if engine else None})
    errors = [r["error"] for r in reports]
    if any(errors):
        if world.is_root:
            _fail(_describe_errors(errors))
        return None
    engine.memory_by_rank = [r["memory"] for r in reports]
    return engine


def _describe_errors(errors: List[Optional[str]]) -> str:
    """One line: the first error, naming the ranks that hit it where not all did."""
    first = next(e for e in errors if e)
    ranks = [r for r, e in enumerate(errors) if e == first]
    if len(ranks) == len(errors):
        return first
    return f"{first} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def _generate(world: World, engine: Engine, command: Command) -> Optional[dict]:
    """GENERATE on every rank; rank 0 returns the result."""
    args = command.args
    params = SamplingParams(**args["sampling"])
    if not engine.runs_dense:
        engine.serve()
        allgather_json(world, mx.get_peak_memory())
        return None
    stream = args.get("stream", False) and world.is_root
    tokens, text, last = [], [], None
    logprobs: List = []
    for response in engine.generate(args["prompt"], params):
        tokens.append(response.token)
        text.append(response.text)
        if args.get("keep_logprobs"):
            logprobs.append(response.logprobs)
        if stream:
            print(response.text, end="", flush=True)
        last = response
    peaks = allgather_json(world, mx.get_peak_memory())
    if not world.is_root:
        return None
    if stream:
        print(flush=True)
    return {
        "text": "".join(text),
        "tokens": tokens,
        "prompt_tokens": len(args["prompt"]),
        "prompt_tps": last.prompt_tps if last else 0.0,
        "generation_tps": last.generation_tps if last else 0.0,
        "finish_reason": last.finish_reason if last else None,
        "peak_memory_gb": [p / 1e9 for p in peaks],
        "weights_gb": [
            {k.replace("_bytes", ""): v / 1e9 for k, v in m.items()} for m in engine.memory_by_rank
        ],
        "dispatch": engine.dispatch,
        "num_ranks": world.size,
        "_logprobs": logprobs,
    }


def serve(world: World) -> int:
    """Ranks other than 0: follow commands until SHUTDOWN."""
    engine = None
    while True:
        command = commands.broadcast(world)
        if command.op == commands.SHUTDOWN:
            return int(command.args.get("exit_code", 0))
        if command.op == commands.LOAD:
            engine = _load(world, command)
        elif command.op == commands.GENERATE:
            _generate(world, engine, command)


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


def _encode_prompt(engine: Engine, text: str, chat: bool) -> List[int]:
    tok = engine.tokenizer
    if chat and tok.chat_template is not None:
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tok.encode(text))


def _print_summary(result: dict) -> None:
    peaks = ", ".join(f"{p:.3f}" for p in result["peak_memory_gb"])
    print(
        f"prompt: {result['prompt_tokens']} tokens, {result['prompt_tps']:.1f} tok/s | "
        f"generation: {len(result['tokens'])} tokens, {result['generation_tps']:.1f} tok/s | "
        f"peak memory (GB) per rank: [{peaks}]",
        file=sys.stderr,
        flush=True,
    )


def command_loop(world: World, args) -> int:
    """Rank 0: LOAD, then GENERATE each prompt, then SHUTDOWN."""

    def shutdown(code: int) -> int:
        commands.broadcast(world, Command(commands.SHUTDOWN, {"exit_code": code}))
        return code

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    params = SamplingParams(args.max_tokens, args.temp, args.top_p, args.top_k, args.min_p, seed, args.prefill_step_size)
    try:
        params.validate()
    except UserError as e:
        _fail(str(e))
        return shutdown(1)
    placement = None
    if args.placement:
        try:
            placement = Placement.load(args.placement).to_json()
        except PlacementError as e:
            _fail(str(e))
            return shutdown(1)
    model = args.model
    if model is None:
        from .synth import default_checkpoint

        model = str(default_checkpoint())
    load = Command(
        commands.LOAD,
        {"model": model, "dispatch": args.dispatch, "placement": placement, "rank0_experts": not args.no_rank0_experts},
    )
    engine = _load(world, commands.broadcast(world, load))
    if engine is None:
        return shutdown(1)
    if args.save_placement:
        engine.placement.save(args.save_placement)

    all_logprobs = []
    for text in _prompts(args):
        try:
            prompt = _encode_prompt(engine, text, args.chat)
            limit = engine.context_length
            if limit is not None and len(prompt) + params.max_tokens > limit:
                raise UserError(
                    f"prompt of {len(prompt)} tokens plus {params.max_tokens} new tokens "
                    f"exceeds the model's context of {limit}"
                )
        except UserError as e:
            _fail(str(e))
            if args.prompt is not None:
                return shutdown(1)
            continue
        generate = Command(
            commands.GENERATE,
            {
                "prompt": prompt,
                "sampling": params.__dict__,
                "stream": not args.json,
                "keep_logprobs": bool(args.logprobs_out),
            },
        )
        result = _generate(world, engine, commands.broadcast(world, generate))
        all_logprobs.extend(result.pop("_logprobs"))
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print_summary(result)
    if args.logprobs_out:
        import numpy as np

        np.save(args.logprobs_out, np.stack([np.array(l) for l in all_logprobs]))
    return shutdown(0)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    world = None
    try:
        world = init_world()
        if world.is_root:
            return command_loop(world, args)
        return serve(world)
    except ProtocolError as e:
        _fail(f"rank {world.rank if world else '?'}: {e}")
        abort(world, 1)
    except KeyboardInterrupt:
        abort(world, 130)
    except Exception as e:
        _fail(f"rank {world.rank if world else '?'}: unexpected {type(e).__name__}: {e}")
        abort(world, 1)


if __name__ == "__main__":
    sys.exit(main())
