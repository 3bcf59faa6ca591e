"""``python -m mlxdist.bench turns``: time to first token of a conversation's
first turn and of the second turn that extends it, per server mode: what
the prompt cache saves an agent that sends its whole conversation each turn.

For each contender (``mlxdist serve`` at ``--ranks`` per ``--mode`` mode;
``mlx_lm.server`` in one process with ``--mlx-lm``) one server is started and
``--conversations`` conversations are held on it one after another, each of
two streamed chat turns (greedy, ``stream_options.include_usage``): turn 1
a system prompt of ``-p`` words and a question; turn 2 the same, the
answer, and a follow-up question. Measured from the client: seconds to the
first text of each turn, and the usage's prompt and cached tokens; the
median conversation is reported.

    python -m mlxdist.bench turns --model DIR --ranks 2 --mode collective,dp -p 1200 [--out DIR]
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from mlxdist.bench.serve import start
from mlxdist.inputs.digits import arg_int

VOCAB = ["expert", "token", "router", "layer", "batch", "rank", "model", "weight", "cache", "mixture"]


def chat_turn(url: str, messages: List[Dict[str, str]], max_tokens: int) -> Dict[str, Any]:
    """One streamed greedy chat turn: seconds to its first text, the text, its usage."""
    where = urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=3600)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{url}: {response.status} {response.read()[:300]!r}")
    first, text, usage = None, "", {}
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - tic
            text += piece
    connection.close()
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": first if first is not None else float("nan"), "text": text,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


def conversation(url: str, words: int, seed: int, max_tokens: int) -> Dict[str, Any]:
    """Two turns of one conversation (its system prompt drawn from ``seed``)."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(VOCAB) for _ in range(words))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {seed}: which rank?"}]
    first = chat_turn(url, messages, max_tokens)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And which layer?"}]
    second = chat_turn(url, messages, max_tokens)
    return {"turn1": first, "turn2": second}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    contenders = (["mlx-lm server"] if args.mlx_lm else []) + [f"mlxdist serve N={args.ranks} {m}" for m in args.mode]
    rows, started = [], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for contender in contenders:
        server, url = start(contender, args, 8)
        try:
            held = [conversation(url, args.prompt_words, args.seed + i, args.generation_tokens)
                    for i in range(args.conversations)]
        finally:
            server.stop()
        for i, c in enumerate(held):
            print(f"# {contender} conversation {i}: turn 1 {c['turn1']['ttft_s']:.2f} s "
                  f"({c['turn1']['prompt_tokens']} tokens, {c['turn1']['cached_tokens']} cached), turn 2 "
                  f"{c['turn2']['ttft_s']:.2f} s ({c['turn2']['prompt_tokens']} tokens, "
                  f"{c['turn2']['cached_tokens']} cached)", file=sys.stderr, flush=True)
        median = sorted(held, key=lambda c: c["turn2"]["ttft_s"])[len(held) // 2]
        rows.append({"contender": contender, "conversations": len(held),
                     "turn1_ttft_s": median["turn1"]["ttft_s"], "turn2_ttft_s": median["turn2"]["ttft_s"],
                     "turn1_prompt_tokens": median["turn1"]["prompt_tokens"],
                     "turn2_prompt_tokens": median["turn2"]["prompt_tokens"],
                     "turn2_cached_tokens": median["turn2"]["cached_tokens"],
                     "turn1_ttft_s_all": [c["turn1"]["ttft_s"] for c in held],
                     "turn2_ttft_s_all": [c["turn2"]["ttft_s"] for c in held]})
    return {"model": args.model, "ranks": args.ranks, "prompt_words": args.prompt_words,
            "generation_tokens": args.generation_tokens,
            "started": started, "rows": rows}


def markdown(report: Dict[str, Any]) -> str:
    head = ("| contender | turn 1 prompt tokens | turn 1 TTFT s | turn 2 prompt tokens | cached | turn 2 TTFT s "
            "| turn 1 / turn 2 |\n|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['contender']} | {r['turn1_prompt_tokens']} | {r['turn1_ttft_s']:.2f} | {r['turn2_prompt_tokens']} | "
        f"{r['turn2_cached_tokens']} | {r['turn2_ttft_s']:.2f} | {r['turn1_ttft_s'] / r['turn2_ttft_s']:.0f} x |"
        for r in report["rows"])


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Checkpoint folder.")
    p.add_argument("--ranks", type=arg_int(1), default=2)
    p.add_argument("--mode", "--dispatch", type=lambda s: s.split(","), default=["collective", "dp"],
                   help="mlxdist server modes, e.g. collective,dp (one contender each)")
    p.add_argument("--mlx-lm", action="store_true", help="Also mlx_lm.server in one process.")
    p.add_argument("-p", "--prompt-words", type=arg_int(1), default=1200, help="Words of the system prompt.")
    p.add_argument("-g", "--generation-tokens", type=arg_int(1), default=16)
    p.add_argument("--conversations", type=arg_int(1), default=3, help="Conversations per contender.")
    p.add_argument("--seed", type=arg_int(0), default=0)
    p.add_argument("--out", default=None, help="Folder for turns.json and turns.md.")
    p.add_argument("--mpirun", default=None, help="mpirun to start mlxdist with (default: this environment's).")
    p.add_argument("--wrapper", default=None, help="Command before python on each rank.")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    report = run(args)
    report["command"] = "python -m mlxdist.bench turns " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "turns.json").write_text(json.dumps(report, indent=1))
        (out / "turns.md").write_text(markdown(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
