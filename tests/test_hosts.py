"""Across hosts, for real: each host a network namespace with its own
address and host name (tests/netns.py), ranks started on them by mpirun
through an rsh agent and by ``mlx.launch`` from a JSON hostfile. The exact
modes equal single-process mlx-lm over MPI and over the ring backend on 2
to 4 hosts, dp stays within its tolerance, a load failing on one host fails
on both in one line, budgets follow the host names of
a budgets file in another order, the server answers a client on another
host, and a cable pulled mid-generation gives the documented behaviour."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, error_lines, last_json
from mlxdist.runtime.survival import MPIRUN_FT_FLAGS
from test_agreement import load_fails_args, load_faults_ran
from test_dataparallel import ARCHS as DP_ARCHS
from test_dataparallel import MAX_TOKENS as DP_MAX_TOKENS
from test_dataparallel import TOLERANCE as DP_TOLERANCE
from test_dataparallel import reference as dp_reference
from test_exact import MAX_TOKENS, PROMPT
from test_exact import reference as exact_reference
from test_serve import KEY, alone

CHECKPOINTS = [("qwen3_moe", None), ("mixtral", 4)]
GENERATE_EACH = ROOT / "tests/scripts/generate_each.py"
# (launcher, backend, dispatch, hosts in rank order)
WORLDS = [("mpirun", "mpi", "collective", [0, 1, 2, 3]),
          ("mpirun", "ring", "collective", [0, 1, 2]), ("mpirun", "ring", "p2p", [0, 1, 2, 3]),
          ("mlx.launch", "ring", "collective", [0, 1, 2])]


def generate_each(hosts, checkpoint, tmp_path, launcher, backend, dispatch, order):
    paths = [str(checkpoint(a, b)) for a, b in CHECKPOINTS]
    args = [GENERATE_EACH, tmp_path, dispatch, "masked", PROMPT, MAX_TOKENS, *paths]
    if launcher == "mpirun":
        proc = hosts.mpirun(order, args, module=None, env={"MLXDIST_BACKEND": backend}, timeout=180)
    else:
        proc = hosts.mlx_launch(order, args[1:], module=None, timeout=180, script=args[0])
    assert proc.returncode == 0 and "exited with code" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    return {p: (s["tokens"], np.load(tmp_path / f"{s['index']}.npy"), s["num_ranks"]) for p, s in summary.items()}


@pytest.mark.parametrize("launcher,backend,dispatch,order", WORLDS,
                         ids=[f"{l}-{b}-{d}-{len(o)}hosts" for l, b, d, o in WORLDS])
def test_exact_modes_across_hosts_equal_mlx_lm(hosts, checkpoint, tmp_path, launcher, backend, dispatch, order):
    runs = generate_each(hosts, checkpoint, tmp_path, launcher, backend, dispatch, order)
    for arch, bits in CHECKPOINTS:
        path = checkpoint(arch, bits)
        ref_tokens, ref_logprobs = exact_reference(path)
        tokens, logprobs, num_ranks = runs[str(path)]
        assert num_ranks == len(order)
        assert tokens == ref_tokens, (arch, bits)
        assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0, (arch, bits)


def test_a_ring_that_cannot_connect_ends_in_one_line(hosts, checkpoint):
    """Every rank told to listen on loopback (MLXDIST_RING_INTERFACE=lo)
    across hosts: MLX's ring would wait forever; the start ends in one line
    per rank within MLXDIST_CONNECT_TIMEOUT."""
    proc = hosts.mpirun([0, 1], ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", 2, "--backend", "ring"],
                        env={"MLXDIST_RING_INTERFACE": "lo", "MLXDIST_CONNECT_TIMEOUT": "5"}, timeout=90)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert lines and all("MLX's ring backend did not" in l for l in lines), proc.stderr[-2000:]


def test_dp_across_hosts_within_its_tolerance(hosts, checkpoint):
    paths = [str(checkpoint(a)) for a in DP_ARCHS]
    proc = hosts.mpirun([1, 3], [ROOT / "tests/scripts/batch_each.py", "dp", "masked",
                                 ",".join(map(str, DP_MAX_TOKENS)), 3, 2048, *paths],
                        module=None, env={"MLXDIST_BACKEND": "ring"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for path, result in last_json(proc.stdout).items():
        ref_tokens, ref_logprobs = dp_reference(path, len(DP_MAX_TOKENS))
        assert result["strategy"] == "dp"
        assert result["tokens"] == ref_tokens
        worst = max(abs(a - b) for g, r in zip(result["logprobs"], ref_logprobs) for a, b in zip(g, r))
        assert worst <= DP_TOLERANCE


def test_a_load_failing_on_one_host_fails_on_both(hosts, checkpoint):
    """test_agreement's failing loads, rank 0 and rank 1 on two hosts: each
    load fails on both hosts, in seconds, with one line naming the rank, and
    the last one generates mlx-lm's tokens."""
    path = checkpoint("qwen3_moe")
    args, env = load_fails_args(path)
    load_faults_ran(hosts.mpirun([0, 1], args, module=None, env=env, timeout=180), path)


def test_budgets_follow_host_names_not_the_order_of_the_file(hosts, checkpoint, tmp_path):
    """--rank-memory hosts.json (mlx.distributed_config's object, each host's
    memory_gb) listing the hosts in another order than the launch: each rank
    gets its own host's budget, so the placement saved gives the most
    experts to the host with the most memory, whatever its rank."""
    path = checkpoint("qwen3_moe")
    budgets = hosts.json_hostfile([2, 0, 1], memory_gb=[0.01, 0.001, 0.002])  # host2 the largest
    saved = tmp_path / "placement.json"
    proc = hosts.mpirun([0, 1, 2], ["--model", path, "-p", "Hello", "-m", 2, "--rank-memory", budgets,
                                    "--save-placement", saved])
    assert proc.returncode == 0, proc.stderr[-3000:]
    owners = json.loads(saved.read_text())["layers"]["0"]
    held = [owners.count(r) for r in range(3)]
    assert held[2] > held[1] > held[0], held  # rank 2 runs on host2


def test_server_answers_a_client_on_another_host(hosts, checkpoint):
    """The server on host0 and host1; the client on host2 reaches host0's address."""
    path = checkpoint("qwen3_moe")
    port = 18080
    proc = hosts.start(0, hosts.mpirun_command([0, 1], [sys.executable, "-m", "mlxdist.serve", "--model", path,
                                                        "--host", "0.0.0.0", "--port", port, "--api-key", KEY]))
    url = f"http://{hosts.addresses[0]}:{port}"
    client = ("import json, sys, urllib.request; r = urllib.request.Request(sys.argv[1] + '/v1/completions', "
              "data=json.dumps({'prompt': 'Hello', 'max_tokens': 6}).encode(), headers={'Authorization': "
              "'Bearer ' + sys.argv[2], 'Content-Type': 'application/json'}); "
              "print(urllib.request.urlopen(r, timeout=60).read().decode())")
    try:
        deadline, answer = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            got = hosts.on(2, [sys.executable, "-c", client, url, KEY], timeout=90)
            if got.returncode == 0:
                answer = json.loads(got.stdout)
                break
            time.sleep(1)
        assert answer is not None, proc.stderr.read()[-3000:] if proc.poll() is not None else "server not up"
        assert answer["choices"][0]["text"] == alone(path, "Hello", 6)
    finally:
        hosts.stop(proc, [0, 1])


def test_a_pulled_cable_mid_generation(hosts, checkpoint):
    """host2's cable pulled while a p2p job streams under --survive (rank 2
    held at step 5 meanwhile, so the pull lands mid-generation): ranks 0
    and 1 lose rank 2 (Open MPI's failure detector) and finish with mlx-lm's
    text, as an undisturbed run, as docs/failures.md says. mpirun itself waits on
    the unreachable host's daemon until TCP keepalive gives it up (minutes;
    docs/launchers.md), so the test ends the job once the text is out."""
    path = checkpoint("qwen3_moe")
    args = ["--model", path, "-p", PROMPT, "-m", 20, "--mode", "p2p", "--ignore-chat-template"]
    cmd = [sys.executable, "-m", "mlxdist.run", *map(str, args)]
    proc = hosts.start(0, hosts.mpirun_command([0, 1, 2], cmd, MPIRUN_FT_FLAGS),
                       env={"MLXDIST_FAULT": "sleep:rank=2,layer=-1,step=5,seconds=30"})
    try:
        first = proc.stdout.read(1)  # the stream has begun
        hosts.link(2, up=False)
        text = first + proc.stdout.readline()
    finally:
        hosts.stop(proc, [0, 1, 2], grace=0)
        hosts.link(2, up=True)
    err = proc.stderr.read()
    assert "mlxdist: warning: lost rank 2; going on with 2" in err, err[-3000:]
    assert text == alone(path, PROMPT, 20) + "\n"


# -- what a Mac's first steps need, checked where they can be on Linux -----------------------------------------


def test_rank_memory_reads_mlx_distributed_config_object(tmp_path):
    from mlxdist.model.budgets import parse_rank_memory

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": [
        {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [], "memory_gb": 64}, {"ssh": "b", "ips": [], "memory_gb": 32}]}))
    assert parse_rank_memory(str(hosts)) == {"a": 64.0, "b": 32.0}


def test_a_mac_rank_holds_a_sleep_assertion_unless_allowed(tmp_path, monkeypatch):
    """caffeinate -i -w PID while the process lives (a stand-in caffeinate
    records its arguments); none with MLXDIST_ALLOW_SLEEP, none off macOS."""
    from mlxdist.runtime import awake

    seen = tmp_path / "args"
    fake = tmp_path / "caffeinate"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert awake.hold("linux") is None
    proc = awake.hold("darwin")
    proc.wait(10)
    assert seen.read_text().split() == ["-i", "-w", str(os.getpid())]
    monkeypatch.setenv("MLXDIST_ALLOW_SLEEP", "1")
    assert awake.hold("darwin") is None


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_a_template_past_its_memory_cap_is_refused(platform):
    """The template child's memory cap where RLIMIT_AS is not enforced
    (macOS's path: RLIMIT_DATA and a watch on resident memory), as on Linux."""
    child = ROOT / "mlxdist/serving/render_child.py"
    run = f"import sys, runpy; sys.platform = {platform!r}; sys.argv = [{str(child)!r}]; runpy.run_path(sys.argv[0], run_name='__main__')"
    job = {"template": "{% set x = 'ab' * 200000000 %}{{ x | length }}", "variables": {}, "memory": 300 << 20,
           "cpu_seconds": 20, "max_chars": 1000}
    proc = subprocess.run([sys.executable, "-c", run], input=json.dumps(job), capture_output=True, text=True, timeout=60)
    assert "error" in json.loads(proc.stdout), proc.stderr[-2000:]
    job["template"] = "{{ 'ab' * 3 }}"
    proc = subprocess.run([sys.executable, "-c", run], input=json.dumps(job), capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout) == {"text": "ababab"}


# -- start-up across hosts: the addresses and backends, as functions -------------------------------------------


def test_the_address_toward_a_peer_is_never_loopback_across_hosts():
    from mlxdist.runtime.addresses import address_toward

    mac1 = {"name": "mac1", "addresses": [["192.168.1.11", 24], ["169.254.10.1", 30], ["169.254.20.1", 30]]}
    mac2 = {"name": "mac2", "addresses": [["192.168.1.12", 24], ["169.254.10.2", 30]]}  # cable 1 to mac1
    mac3 = {"name": "mac3", "addresses": [["169.254.20.2", 30]]}  # cable 2 to mac1 only
    assert address_toward(mac1, dict(mac1)) == "127.0.0.1"  # one host
    assert address_toward(mac1, mac2) == "192.168.1.11"  # the first network both are on
    assert address_toward(mac1, mac3) == "169.254.20.1"  # one address per cable
    assert address_toward(mac3, mac1) == "169.254.20.2"
    with pytest.raises(RuntimeError, match="no route from host mac3 to host nowhere"):
        address_toward(mac3, {"name": "nowhere", "addresses": []})


def test_the_address_toward_a_peer_from_the_route_and_the_interfaces(hosts):
    """On host0: its own interfaces (eth0 on the bridge, loopback left out),
    the route's source toward a peer on no network it lists, and the address
    of a named interface."""
    script = ("import json; from mlxdist.runtime.addresses import address_toward, describe_host; "
              "me = describe_host(); peer = {'name': 'x', 'addresses': [['198.18.0.11', 32]]}; "
              "print(json.dumps([me, address_toward(dict(me, addresses=[]), peer), "
              "address_toward(me, peer, 'lo')]))")
    proc = hosts.on(0, [sys.executable, "-c", script])
    assert proc.returncode == 0, proc.stderr
    me, routed, named = json.loads(proc.stdout)
    assert me == {"name": "host0", "addresses": [[hosts.addresses[0], 24]]}
    assert routed == hosts.addresses[0]
    assert named == "127.0.0.1"  # what was asked for: the doctor names it as a problem (test_doctor.py)


def test_jaccl_ring_needs_cables_between_neighbours_only(tmp_path, monkeypatch):
    from mlxdist.runtime.backends import jaccl_environment, launched_backend, read_devices
    from mlxdist.runtime.world import BACKENDS

    ring = [[None, "rdma_en1", None, "rdma_en4"], ["rdma_en1", None, "rdma_en2", None],
            [None, "rdma_en2", None, "rdma_en3"], ["rdma_en4", None, "rdma_en3", None]]
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(ring))
    assert read_devices(str(path), 4, ring=True) == ring
    with pytest.raises(RuntimeError, match="no RDMA device from rank 0 to rank 2 .*or use jaccl-ring"):
        read_devices(str(path), 4)
    assert jaccl_environment(2, ring, "10.0.0.1:5000", ring=True)["MLX_JACCL_RING"] == "1"
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:5000")
    monkeypatch.setenv("MLX_JACCL_RING", "1")  # as mlx.launch --backend jaccl-ring sets it
    assert launched_backend() == "jaccl-ring"
    assert "jaccl-ring" in BACKENDS  # --backend's choices; refused in one line without RDMA as jaccl is


MARKED_TOKENIZER = '''import os

from transformers import PreTrainedTokenizerFast


class MarkedTokenizer(PreTrainedTokenizerFast):
    """A tokenizer shipped as code in its repository (as Kimi K2's is)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with open(os.environ["MLXDIST_TEST_MARK"], "w") as f:
            f.write("ran")
'''


def test_a_tokenizer_that_is_code_runs_only_with_trust_remote_code(checkpoint, tmp_path):
    """The repository's tokenizer code runs with --trust-remote-code and
    never without (one process: the flag reaches mlx-lm's loader)."""
    import shutil

    from conftest import launch

    model = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3_moe"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MarkedTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "tokenization_marked.py").write_text(MARKED_TOKENIZER)
    mark = tmp_path / "mark"
    env = {"MLXDIST_TEST_MARK": str(mark), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    untrusted = launch(0, ["--model", model, "-p", "Hello", "-m", 2], env=env)
    assert not mark.exists(), untrusted.stderr[-2000:]  # transformers falls back to tokenizer.json, or fails
    trusted = launch(0, ["--model", model, "-p", "Hello", "-m", 2, "--trust-remote-code"], env=env)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert mark.read_text() == "ran"
