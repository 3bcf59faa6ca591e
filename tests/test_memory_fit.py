"""Memory found by itself (runtime/memory.py; docs/memory.md): with no
budgets, the even placement follows what each rank can hold after its dense
part, a KV reserve (mlx-lm's own cache for --kv-reserve-tokens tokens) and a
margin, and a model that fits no way is refused, naming the rank, before a
byte is read; the doctor says the same, by the same function
(model/fit.py). Each rank's figure comes from the test-only override
MLXDIST_TEST_MEMORY_GB."""

import functools
import json
import sys

from conftest import error_lines, last_json, launch
from mlxdist.config import KV_RESERVE_TOKENS
from test_exact import MAX_TOKENS, PROMPT, reference


# The qwen3_moe test checkpoint's cache, by hand: 3 layers x (keys + values) 2 x 4 KV heads x head_dim 16
# x 4 bytes (float32) a token.
KV_PER_TOKEN = 3 * 2 * 4 * 16 * 4


@functools.lru_cache(maxsize=None)
def _figures(path, tokens=KV_RESERVE_TOKENS):
    """(dense bytes, KV reserve bytes for ``tokens``, expert bytes of the whole model) of a checkpoint, from one
    rank's load (once per session)."""
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (3, 4, 16)
    got = _weights(path)
    return got["dense"] * 1e9, tokens * KV_PER_TOKEN, got["expert"] * 1e9


@functools.lru_cache(maxsize=None)
def _weights(path):
    return last_json(launch(0, ["--model", path, "-p", "hi", "-m", "1", "--json"]).stdout)["weights_gb"][0]


def _run(path, memory_gb, *args):
    return launch(2, ["--model", path, "-p", PROMPT, "-m", MAX_TOKENS, "--json", "--ignore-chat-template",
                      "--mode", "collective", *args], env={"MLXDIST_TEST_MEMORY_GB": memory_gb})


def test_shares_follow_the_memory_each_rank_finds(checkpoint):
    from mlxdist.model.fit import MARGIN

    path = checkpoint("qwen3_moe")
    dense, kv, experts = _figures(path)
    room = [experts / 4, 3 * experts / 4]  # rank 1 can hold three times rank 0's experts
    memory = [(1.05 * r + dense + kv) / (1 - MARGIN) for r in room]
    proc = _run(path, ",".join(f"{m / 1e9:.9f}" for m in memory))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = last_json(proc.stdout)
    assert got["tokens"] == reference(path)[0]
    held = [w["expert"] * 1e9 for w in got["weights_gb"]]
    assert 2.5 < held[1] / held[0] < 3.5, held


def test_a_model_that_fits_no_way_is_refused_naming_the_rank(checkpoint):
    from mlxdist.model.fit import MARGIN

    path = checkpoint("qwen3_moe")
    dense, kv, experts = _figures(path)
    memory = (experts / 3 + dense + kv) / (1 - MARGIN)  # two thirds of the experts fit on two such ranks
    proc = _run(path, f"{memory / 1e9:.9f}")
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0 and lines, proc.stderr[-2000:]
    assert lines[0].startswith("mlxdist: error: rank 0 (host ") and "the model does not fit" in lines[0], lines[0]
    proc = _run(path, f"{dense / 1e9:.9f}")
    lines = error_lines(proc.stderr)
    assert lines and "rank 0 (host " in lines[0] and "the model does not fit" in lines[0], lines[0]


def test_the_load_and_the_doctor_agree_on_the_fit(checkpoint):
    """Memory just below and just above what each rank needs (its dense
    part, its half of the experts and 20,000 tokens of the model's float32
    KV cache, over 90 %): the load refuses, naming the rank, the numbers and
    the ways out, and the doctor gives the same line; above, the load
    generates and the doctor is ready. --rank-memory budgets below each
    rank's expert weights: the same refusal from both."""
    from mlxdist.model.fit import MARGIN

    path = checkpoint("qwen3_moe")
    tokens = 20000
    dense, kv, experts = _figures(path, tokens)
    need = dense + experts / 2 + kv
    fit = ["--mode", "collective", "--kv-reserve-tokens", tokens]

    def both(memory_gb, *extra):
        env = {"MLXDIST_TEST_MEMORY_GB": f"{memory_gb:.9f}"}
        load = launch(2, ["--model", path, "-p", "hi", "-m", 2, "--json", *fit, *extra], env=env, timeout=240)
        doctor = launch(2, ["--model", path, "--backend", "mpi", *fit, *extra], module="mlxdist.doctor", env=env,
                        timeout=240)
        return load, doctor

    load, doctor = both(0.98 * need / (1 - MARGIN) / 1e9)
    refused = error_lines(load.stderr)
    assert load.returncode != 0 and len(refused) == 1 and "Traceback" not in load.stderr, load.stderr[-3000:]
    line = refused[0][len("mlxdist: error: "):]
    assert line.startswith("rank 0 (host ") and f"+ KV {kv / 1e9:.3g} GB for {tokens} tokens; has" in line, line
    assert "--rank-memory" in line and "--expert-capacity" in line and "--kv-reserve-tokens" in line, line
    problems = error_lines(doctor.stderr, "mlxdist doctor: problem: ")
    assert doctor.returncode == 1 and problems[0] == f"mlxdist doctor: problem: {line}", doctor.stderr[-3000:]
    load, doctor = both(1.02 * need / (1 - MARGIN) / 1e9)
    assert load.returncode == 0 and len(last_json(load.stdout)["tokens"]) == 2, load.stderr[-3000:]
    assert doctor.returncode == 0 and "mlxdist doctor: ready" in doctor.stderr, doctor.stderr[-3000:]
    budget = f"{0.98 * experts / 2 / 1e9:.9f}"
    load, doctor = both(1.0, "--rank-memory", f"{budget},{budget}")
    refused = error_lines(load.stderr)
    assert load.returncode != 0 and refused and refused[0].startswith("mlxdist: error: rank 0 holds 18 experts: "), \
        load.stderr[-3000:]
    problems = error_lines(doctor.stderr, "mlxdist doctor: problem: ")  # every rank that does not fit: 0 and 1
    assert problems[0] == f"mlxdist doctor: problem: {refused[0][len('mlxdist: error: '):]}", doctor.stderr[-3000:]
    assert len(problems) == 2 and problems[1].startswith("mlxdist doctor: problem: rank 1 holds 18 experts: ")


def test_budgets_per_host_are_matched_by_host_name(checkpoint, tmp_path):
    """Two ranks on hosts h0 and h1 (a UTS namespace each); the JSON hostfile lists h1 first with three times
    h0's budget: rank 1 (on h1) holds three times rank 0's experts. A host the file does not name is refused."""
    from test_share import VIEW

    path = checkpoint("qwen3_moe")
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "h1", "memory_gb": 3.0}, {"ssh": "h0", "memory_gb": 1.0}]))
    view = [VIEW, "--ranks", "0,1", "--hostname-prefix", "h", "--", sys.executable, "-m", "mlxdist.run",
            "--model", path, "-p", PROMPT, "-m", MAX_TOKENS, "--json", "--ignore-chat-template", "--mode",
            "collective", "--rank-memory"]
    proc = launch(2, [*view, hosts], module=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = last_json(proc.stdout)
    assert got["tokens"] == reference(path)[0]
    held = [w["expert"] for w in got["weights_gb"]]
    assert held[1] == 3 * held[0], held
    proc = launch(2, [*view, "h0=1"], module=None)
    lines = error_lines(proc.stderr)
    assert lines and "rank 1 runs on host h1, which --rank-memory does not name" in lines[0], proc.stderr[-2000:]


def test_a_hosts_budget_is_split_over_its_ranks(checkpoint, tmp_path):
    """Three ranks, two on this machine and rank 2 on host h2 (a UTS namespace); the JSON hostfile lists this
    machine once per rank (mlx.launch's form) by another spelling of its name (upper case, a domain) with 4 GB,
    and h2 with 1 GB: ranks 0 and 1 get 2 GB each, rank 2 1 GB, so they hold experts 2 : 2 : 1 (5, 5 and 2
    of 12 a layer), with mlx-lm's tokens."""
    import socket

    from test_share import VIEW

    path = checkpoint("qwen3_moe")
    here = f"{socket.gethostname().split('.')[0].upper()}.local"
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": here, "memory_gb": 4.0}, {"ssh": here, "memory_gb": 4.0},
                                 {"ssh": "h2", "memory_gb": 1.0}]))
    proc = launch(3, [VIEW, "--ranks", "2", "--hostname-prefix", "h", "--", sys.executable, "-m", "mlxdist.run",
                      "--model", path, "-p", PROMPT, "-m", MAX_TOKENS, "--json", "--ignore-chat-template",
                      "--mode", "collective", "--rank-memory", hosts], module=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = last_json(proc.stdout)
    assert got["tokens"] == reference(path)[0]
    held = [w["expert"] for w in got["weights_gb"]]
    assert held[0] == held[1] and abs(held[0] - 2.5 * held[2]) <= 1e-9 * held[0], held
