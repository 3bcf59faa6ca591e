"""``python -m mlxdist.bench.serve``: the HTTP server under load, against
``mlx_lm.server`` in one process on the same checkpoint.

For each contender and each concurrency c, c clients each send ``-r``
streaming completions of ``-g`` tokens (greedy, random prompts of ``-p``
tokens' worth of words) back to back; measured per request: time to the
first token (TTFT) and its tokens; per level: output tok/s (all tokens /
wall time), TTFT p50 / p99 and requests/s. Contenders run in alternating
rounds (``--rounds``); the median round is kept.

    python -m mlxdist.bench.serve --model DIR --ranks 2 -c 1,8,32 [--out benchmarks/out/serve]
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

from mlxdist.cli.relaunch import find_mpirun
from mlxdist.inputs.digits import arg_int, arg_number
from mlxdist.runtime.backends import free_port
from mlxdist.runtime.launcher import new_session_base, session_env

ROOT = Path(__file__).resolve().parents[2]


class Launched:
    """A server process (group) answering on a free loopback port, its Open
    MPI session in a folder of its own (``launcher.new_session_base``)."""

    def __init__(self, name: str, cmd: List[str]):
        self.name = name
        env = dict(os.environ)  # the server's: this one's, able to run as root, offline, this checkout first
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
        self.session_base = new_session_base()
        env.update(session_env(self.session_base))
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def wait_ready(self, url: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.proc.stderr.read()[-1500:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up in {timeout:g} s")

    def stop(self) -> str:
        """Stop the server; what it wrote to stderr."""
        if self.proc.poll() is None:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.session_base, ignore_errors=True)
        return self.proc.stderr.read()


def rebalances(stderr: str) -> List[float]:
    """The seconds of each live placement a server logged (``serving/rebalance.py``)."""
    return [float(t) for t in re.findall(r"experts placed again in ([0-9.]+) s", stderr)]


def server_command(contender: str, args: argparse.Namespace, port: int, max_concurrent: int) -> List[str]:
    """How ``contender`` ("mlx-lm server", "mlxdist serve N=2 MODE" or that
    followed by " rebalancing") is started on ``port``."""
    if contender == "mlx-lm server":
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", args.model, "--port", str(port),
               "--decode-concurrency", str(max_concurrent), "--log-level", "WARNING"]
    else:
        cmd = [args.mpirun or find_mpirun(), "-np", str(args.ranks), "--oversubscribe", "--bind-to", "none",
               "--stdin", "none", *(args.wrapper.split() if args.wrapper else []),
               sys.executable, "-m", "mlxdist.serve", "--model", args.model, "--port", str(port),
               "--max-concurrent", str(max_concurrent), "--mode", contender.split(" ")[3]]
        if contender.endswith("rebalancing"):
            cmd += ["--rebalance-every", str(args.rebalance_every), "--rebalance-duplicates", str(args.rebalance_duplicates)]
    return cmd


def start(contender: str, args: argparse.Namespace, max_concurrent: int) -> "tuple[Launched, str]":
    port = free_port()
    server = Launched(contender, server_command(contender, args, port, max_concurrent))
    url = f"http://127.0.0.1:{port}"
    server.wait_ready(url)
    return server, url


def one_request(url: str, prompt: str, max_tokens: int) -> Dict[str, float]:
    """A streaming completion: seconds to the first token, tokens, seconds in all."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    tic = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                tokens += 1
                first = first if first is not None else time.perf_counter() - tic
    return {"ttft": first if first is not None else float("nan"), "tokens": tokens, "seconds": time.perf_counter() - tic}


def load_level(url: str, prompts: List[str], clients: int, per_client: int, max_tokens: int) -> Dict[str, Any]:
    """``clients`` clients, each sending ``per_client`` requests back to back."""
    records: List[Dict[str, float]] = []
    resets = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        # mlx_lm.server listens with a backlog of 5: bursts of connections are
        # reset; a client then tries again (counted), as a real one would.
        for j in range(per_client):
            for _ in range(50):
                try:
                    rec = one_request(url, prompts[(i * per_client + j) % len(prompts)], max_tokens)
                    break
                except (ConnectionError, urllib.error.URLError):
                    with lock:
                        resets[0] += 1
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"{url}: 50 connections reset in a row")
            with lock:
                records.append(rec)

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    ttft = sorted(r["ttft"] for r in records)
    return {
        "concurrency": clients,
        "requests": len(records),
        "output_tps": sum(r["tokens"] for r in records) / wall,
        "requests_per_s": len(records) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "wall_s": wall,
        "connection_resets": resets[0],
    }


def random_prompts(n: int, words: int, seed: int = 0) -> List[str]:
    import random

    rng = random.Random(seed)
    vocab = ["expert", "token", "router", "layer", "batch", "rank", "model", "weight", "cache", "mixture"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def run(args) -> Dict[str, Any]:
    prompts = random_prompts(64, args.prompt_words, args.seed)
    contenders = ["mlx-lm server"] + [f"mlxdist serve N={args.ranks} {mode}" for mode in args.mode]
    if args.rebalance_every:  # the same server, placing its experts again as it runs
        contenders += [f"mlxdist serve N={args.ranks} {mode} rebalancing" for mode in args.mode]
    rounds: Dict[str, List[List[Dict[str, Any]]]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for contender in contenders if r % 2 == 0 else contenders[::-1]:
            server, url = start(contender, args, max(args.concurrency))
            try:
                for c in args.concurrency:  # warm-up: each level's batch shapes once (CUDA compiles them)
                    load_level(url, prompts, c, 1, 8)
                levels = [load_level(url, prompts, c, args.requests, args.generation_tokens) for c in args.concurrency]
            finally:
                placed = rebalances(server.stop())
            for lv in levels:
                lv.update(rebalances=len(placed), rebalance_s_max=max(placed, default=None))
            rounds[contender].append(levels)
            for lv in levels:
                print(f"# {contender} round {r}: c={lv['concurrency']} {lv['output_tps']:.1f} tok/s, "
                      f"TTFT p50 {lv['ttft_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
    rows = []
    for contender, runs in rounds.items():
        for i, c in enumerate(args.concurrency):
            by_tps = sorted((run[i] for run in runs), key=lambda lv: lv["output_tps"])
            rows.append({"contender": contender, **by_tps[len(by_tps) // 2]})
    base = {r["concurrency"]: r["output_tps"] for r in rows if r["contender"] == "mlx-lm server"}
    for r in rows:
        r["x_mlx_lm_server"] = r["output_tps"] / base[r["concurrency"]]
    return {"model": args.model, "ranks": args.ranks, "generation_tokens": args.generation_tokens,
            "prompt_words": args.prompt_words, "requests_per_client": args.requests, "rounds": args.rounds,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}


def markdown(report: Dict[str, Any]) -> str:
    head = ("| contender | concurrency | requests | output tok/s | × mlx-lm server | TTFT p50 ms | TTFT p99 ms | req/s "
            "| connections reset | live placements (slowest s) |\n|---|---|---|---|---|---|---|---|---|---|\n")

    def placed(r):
        return f"{r['rebalances']} ({r['rebalance_s_max']:.3f})" if r.get("rebalances") else "-"

    return head + "\n".join(
        f"| {r['contender']} | {r['concurrency']} | {r['requests']} | {r['output_tps']:.1f} | "
        f"{r['x_mlx_lm_server']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['requests_per_s']:.2f} "
        f"| {r['connection_resets']} | {placed(r)} |" for r in report["rows"])


def plot(report: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for contender in dict.fromkeys(r["contender"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["contender"] == contender]
        xs = [r["concurrency"] for r in rows]
        a.plot(xs, [r["output_tps"] for r in rows], marker="o", label=contender)
        b.plot(xs, [r["ttft_p50_ms"] for r in rows], marker="o", label=contender)
    for ax, title in ((a, "output tok/s"), (b, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlxdist.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Checkpoint folder (both servers load it).")
    p.add_argument("--ranks", type=arg_int(), default=2)
    p.add_argument("-c", "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("-r", "--requests", type=arg_int(), default=4, help="Requests per client at each level.")
    p.add_argument("-g", "--generation-tokens", type=arg_int(), default=32)
    p.add_argument("-p", "--prompt-words", type=arg_int(), default=32)
    p.add_argument("--rounds", type=arg_int(), default=1)
    p.add_argument("--seed", type=arg_int(), default=0)
    p.add_argument("--out", default=None, help="Folder for serve.json, serve.md and serve.png.")
    p.add_argument("--mode", "--dispatch", type=lambda s: s.split(","), default=["collective"],
                   help="mlxdist server modes to run, e.g. collective,dp (one contender each)")
    p.add_argument("--rebalance-every", type=arg_number(), default=None, metavar="SECONDS",
                   help="Also run each mlxdist server with --rebalance-every SECONDS (one more contender each).")
    p.add_argument("--rebalance-duplicates", "--rebalance-replicas", type=arg_int(), default=1,
                   help="Its --rebalance-duplicates (--rebalance-replicas: the old name).")
    p.add_argument("--mpirun", default=None, help="mpirun to start mlxdist with (default: this environment's).")
    p.add_argument("--wrapper", default=None,
                   help="Command before python on each rank, e.g. benchmarks/gpu/rank.sh (one GPU per rank).")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    report = run(args)
    report["command"] = "python -m mlxdist.bench.serve " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(report))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").write_text(json.dumps(report, indent=1))
        (out / "serve.md").write_text(markdown(report) + "\n")
        plot(report, out / "serve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
