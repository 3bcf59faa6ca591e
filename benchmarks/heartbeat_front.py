"""What the heartbeat and the front cost on the data path, measured in one run:

1. steady-state decode tok/s of ``python -m mlxdist.run`` at ``--ranks`` with
   ``--heartbeat off`` and ``--heartbeat 5``, one launch each, in
   interleaved pairs (the order alternates, so the machine's drift hits both
   alike); each launch generates ``-g`` tokens for 3 prompts and keeps the
   median of the last 2 (the first warms up);
2. the API's command thread (``runtime/rank0_thread.py``): steady-state
   decode tok/s of a script's ``stream_generate`` with ``init(raise_rank_lost=True)``
   (every step handed to rank 0's command thread, so that ``RankLost`` can
   wake the caller) and ``False`` (the caller's thread), one launch each,
   in interleaved pairs, 3 prompts a launch, the median of the last 2;
3. the front's overhead per request: one front (``python -m mlxdist.serve
   --ranks N``, in this process) and its rank server, the same greedy
   request (``-m`` tokens, not streamed) sent to each in interleaved pairs;
   the overhead is the median of the per-pair differences (front - direct).

Prints one JSON line per pair and one summary line per part.

    python benchmarks/heartbeat_front.py --model DIR [--ranks 2] [--pairs 4] [-g 128] [--requests 20] [-m 16]
        [--skip-heartbeat] [--skip-api] [--skip-front]

Without ``--model`` it writes the synthetic 4-bit 2-layer ``bench-small`` checkpoint first.
"""

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["the weather today is", "a story about the sea", "the weather today is"]


def decode_tps(model: str, ranks: int, heartbeat: str, tokens: int) -> float:
    """Median decode tok/s of the measured prompts of one launch."""
    cmd = [str(ROOT / "launch/mpirun"), "-np", str(ranks), sys.executable, "-m", "mlxdist.run", "--model", model,
           "--heartbeat", heartbeat, "-m", str(tokens), "--ignore-chat-template", "--json"]
    for _ in range(2):  # once more where the launcher itself failed to start (PMIx's listener, now and then)
        done = subprocess.run(cmd, input="\n".join(PROMPTS) + "\n", capture_output=True, text=True, cwd=ROOT,
                              timeout=900)
        if done.returncode == 0 or "PMIx" not in done.stderr:
            break
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    rates = [json.loads(line)["generation_tps"] for line in done.stdout.splitlines() if line.startswith("{")]
    if len(rates) != len(PROMPTS):
        raise SystemExit(f"error: expected {len(PROMPTS)} JSON lines, got {done.stdout[-2000:]!r}")
    return statistics.median(rates[1:])


def interleaved_pairs(measure, first: str, second: str, pairs: int, label: str) -> List[Dict[str, float]]:
    """``pairs`` rows {first: measure(first), second: measure(second)}, the
    order alternating (the machine's drift hits both alike); each printed
    as one JSON line under ``label``."""
    rows = []
    for i in range(pairs):
        row = {}
        for name in ((first, second) if i % 2 == 0 else (second, first)):
            row[name] = measure(name)
        rows.append(row)
        print(json.dumps({label: row}), flush=True)
    return rows


def heartbeat_pairs(model: str, ranks: int, pairs: int, tokens: int) -> dict:
    rows = interleaved_pairs(lambda heartbeat: decode_tps(model, ranks, heartbeat, tokens), "off", "5", pairs,
                             "heartbeat_pair")
    ratios = [r["5"] / r["off"] for r in rows]
    return {"heartbeat": {"off_tok_s": statistics.median(r["off"] for r in rows),
                          "on_5s_tok_s": statistics.median(r["5"] for r in rows),
                          "median_ratio_on_off": statistics.median(ratios), "ratios": ratios}}


API_SCRIPT = """
import json, sys
import mlxdist
model, tokens, thread, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "thread", sys.argv[4:]
with mlxdist.init(raise_rank_lost=thread) as cluster:
    cluster.load(model)
    rates = []
    for prompt in prompts:
        stats = {}
        request = cluster.request([cluster.encode(prompt)], max_tokens=tokens)
        for _ in cluster.stream(request, stats):
            pass
        rates.append(stats["generation_tps"])
    print(json.dumps(rates))
"""


def api_tps(model: str, ranks: int, thread: bool, tokens: int) -> float:
    """Median decode tok/s of the measured prompts of one API script's launch."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "api_decode.py"
        script.write_text(API_SCRIPT)
        cmd = [str(ROOT / "launch/mpirun"), "-np", str(ranks), sys.executable, str(script), model, str(tokens),
               "thread" if thread else "caller", *PROMPTS]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1])[1:])


def api_pairs(model: str, ranks: int, pairs: int, tokens: int) -> dict:
    rows = interleaved_pairs(lambda way: api_tps(model, ranks, way == "thread", tokens), "thread", "caller", pairs,
                             "api_pair")
    ratios = [r["thread"] / r["caller"] for r in rows]
    return {"api_thread": {"caller_tok_s": statistics.median(r["caller"] for r in rows),
                           "thread_tok_s": statistics.median(r["thread"] for r in rows),
                           "median_ratio_thread_caller": statistics.median(ratios), "ratios": ratios}}


def front_pairs(model: str, ranks: int, requests: int, tokens: int) -> dict:
    """The front in this process's main thread (uvicorn takes its signals),
    the measuring in a thread that ends it with SIGINT."""
    from mlxdist.front.job import JobSpec, RankJob
    from mlxdist.front.serve import bind, serve
    from mlxdist.front.settings import read_settings

    settings = read_settings(["--ranks", str(ranks), "--model", model, "--port", "0"])
    listening = bind(settings.host, 0)
    import dataclasses

    settings = dataclasses.replace(settings, port=listening.getsockname()[1])
    job = RankJob(JobSpec.from_settings(settings))
    result = {}

    def measure() -> None:
        import httpx

        try:
            deadline = time.monotonic() + 900
            while job.state != "ok":  # "stopped" until serve() starts it, and where it stops by itself
                if job.error is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the front's job did not serve: {job.error}")
                time.sleep(0.2)
            body = {"prompt": PROMPTS[0], "max_tokens": tokens, "temperature": 0}
            urls = {"front": (f"http://127.0.0.1:{settings.port}", {}),
                    "direct": (job.base_url, {"Authorization": f"Bearer {job.api_key}"})}
            with httpx.Client(timeout=300, trust_env=False) as client:
                for url, headers in urls.values():  # warm-up, and both answer alike
                    client.post(url + "/v1/completions", json=body, headers=headers).raise_for_status()
                def seconds(name: str) -> float:
                    url, headers = urls[name]
                    start = time.perf_counter()
                    client.post(url + "/v1/completions", json=body, headers=headers).raise_for_status()
                    return time.perf_counter() - start

                rows = interleaved_pairs(seconds, "front", "direct", requests, "front_pair_s")
            overheads = [r["front"] - r["direct"] for r in rows]
            result["front"] = {"requests": requests, "max_tokens": tokens,
                               "front_s": statistics.median(r["front"] for r in rows),
                               "direct_s": statistics.median(r["direct"] for r in rows),
                               "median_overhead_ms": 1000 * statistics.median(overheads)}
        except BaseException as e:  # noqa: BLE001 - said, and the front ended all the same
            result["error"] = repr(e)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=measure, daemon=True).start()
    asyncio.run(serve(settings, listening, job))
    if "error" in result:
        raise SystemExit(f"error: {result['error']}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: bench-small, written to a temporary folder)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--pairs", type=int, default=4, help="launch pairs (heartbeat off / 5)")
    p.add_argument("-g", "--generation-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=20, help="request pairs (front / direct)")
    p.add_argument("-m", "--max-tokens", type=int, default=16, help="tokens of each front/direct request")
    p.add_argument("--skip-heartbeat", action="store_true")
    p.add_argument("--skip-api", action="store_true")
    p.add_argument("--skip-front", action="store_true")
    args = p.parse_args()
    for name in ("ranks", "pairs", "generation_tokens", "requests", "max_tokens"):
        if not 1 <= getattr(args, name) <= 100_000:
            p.error(f"--{name.replace('_', '-')} must be from 1 to 100000")
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="mlxdist-bench-small-")
        subprocess.run([sys.executable, "-m", "mlxdist.synth", "--preset", "bench-small", "--bits", "4", "--layers", "2",
                        model], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if not args.skip_heartbeat:
        print(json.dumps(heartbeat_pairs(model, args.ranks, args.pairs, args.generation_tokens)), flush=True)
    if not args.skip_api:
        print(json.dumps(api_pairs(model, args.ranks, args.pairs, args.generation_tokens)), flush=True)
    if not args.skip_front:
        print(json.dumps(front_pairs(model, args.ranks, args.requests, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
