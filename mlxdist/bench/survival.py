"""``python -m mlxdist.bench.survival`` under ``launch/mpirun --survive``: the
time from a lost rank to the next token, in a p2p generation that goes on.

    launch/mpirun --survive -np 3 python -m mlxdist.bench.survival --model DIR [-g 64 --at 32 --victim 2 --json]

One undisturbed generation first (the reference tokens and the usual time
per token), then the same generation again, during which rank 0 sends
SIGKILL to ``--victim`` right after token ``--at`` arrives (the victim must
run on rank 0's host). Reported: the time from the kill to the next token,
the median time per token before and after it (rank 0 computes the lost
experts from then on), and whether the tokens equal the reference's.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from mlxdist.inputs.digits import arg_int
from mlxdist.commands.executor import register_probe
from mlxdist.bench.harness import random_prompts
from mlxdist.model.checkpoint import text_config


@register_probe("process")
def process(executor, args: Dict[str, Any]) -> Dict[str, Any]:
    """Where this rank runs: host name and process id."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "rank": executor.world.rank}


def timed_stream(cluster, request, kill_pid: Optional[int] = None, at: int = 0):
    """Tokens and each one's arrival time; SIGKILL to ``kill_pid`` after token ``at``."""
    tokens, times, killed_at = [], [], None
    tic = time.perf_counter()
    for piece in cluster.stream(request):
        tokens.append(piece.token)
        times.append(time.perf_counter() - tic)
        if kill_pid is not None and len(tokens) == at:
            os.kill(kill_pid, signal.SIGKILL)
            killed_at = time.perf_counter() - tic
    return tokens, times, killed_at


def main(argv: Optional[List[str]] = None) -> int:
    import mlxdist

    p = argparse.ArgumentParser(prog="python -m mlxdist.bench.survival", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("-p", "--prompt-tokens", type=arg_int(), default=32)
    p.add_argument("-g", "--generation-tokens", type=arg_int(), default=64)
    p.add_argument("--at", type=arg_int(), default=32, help="kill after this many tokens")
    p.add_argument("--victim", type=arg_int(), default=2, help="the rank to kill (on rank 0's host)")
    p.add_argument("--expert-capacity", type=arg_int(), default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with mlxdist.init(timeout=600) as cluster:
        if not cluster.world.tolerant:
            raise mlxdist.UserError("launch this under launch/mpirun --survive (Open MPI's fault tolerance)")
        cluster.load(args.model, mode="p2p", expert_capacity=args.expert_capacity)
        cluster.probe("no_eos")
        victim = next((r for r in cluster.probe("process") if r["rank"] == args.victim), None)
        if victim is None or args.victim == 0 or victim["host"] != socket.gethostname():
            raise mlxdist.UserError(f"--victim {args.victim} must be a rank other than 0 on rank 0's host")
        vocab = text_config(cluster.engine.config)["vocab_size"]
        prompt = random_prompts(vocab, 1, args.prompt_tokens, 0)[0]
        request = cluster.request([prompt], max_tokens=args.generation_tokens)
        timed_stream(cluster, cluster.request([prompt], max_tokens=8))  # warm-up
        reference, ref_times, _ = timed_stream(cluster, request)
        tokens, times, killed_at = timed_stream(cluster, request, victim["pid"], args.at)
    gaps = [b - a for a, b in zip(times, times[1:])]
    report = {
        "model": args.model, "ranks": cluster.world.size, "victim": args.victim, "at": args.at,
        "expert_capacity": args.expert_capacity,
        "kill_to_next_token_s": times[args.at] - killed_at,
        "per_token_before_s": statistics.median(gaps[1 : args.at - 1]),
        "per_token_after_s": statistics.median(gaps[args.at + 1 :]),
        "reference_per_token_s": statistics.median([b - a for a, b in zip(ref_times[1:], ref_times[2:])]),
        "tokens_equal_reference": tokens == reference,
        "lost": cluster.world.lost,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"lost rank {args.victim} after token {args.at}: next token {1e3 * report['kill_to_next_token_s']:.1f} ms "
              f"after the kill (a token took {1e3 * report['per_token_before_s']:.1f} ms before, "
              f"{1e3 * report['per_token_after_s']:.1f} ms after); tokens equal the undisturbed run's: "
              f"{report['tokens_equal_reference']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
