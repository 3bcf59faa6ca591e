"""MLX's ring and JACCL backends for the arrays, mpi4py for the control plane
(real mpirun on localhost), and MLX's collectives for both under real
``mlx.launch``: the exact modes equal single-process mlx-lm over ring, dp
stays within its tolerance, the server answers as mlx-lm does, and JACCL,
which this Linux MLX lacks, is refused in one line after its environment is
built as ``mlx.launch`` builds it."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import error_lines, last_json, launch
from shared_launch import launch_several
from test_dataparallel import ARCHS as DP_ARCHS
from test_dataparallel import MAX_TOKENS as DP_MAX_TOKENS
from test_dataparallel import TOLERANCE as DP_TOLERANCE
from test_dataparallel import batch_run
from test_dataparallel import reference as dp_reference
from test_exact import MAX_TOKENS, generated
from test_exact import reference as exact_reference
from test_serve import KEY, Server, alone, completion

MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
RING = {"MLXDIST_BACKEND": "ring", "MLX_RING_VERBOSE": "1"}  # MLX's ring backend says it connected
CHECKPOINTS = [("qwen3_moe", None), ("mixtral", 4)]
WORLDS = [("collective", 2), ("collective", 3), ("collective", 4), ("p2p", 3)]


_RING = {}


@pytest.fixture(scope="module")
def over_ring(checkpoint, tmp_path_factory):
    """(mode, nranks) -> its result over ring, one launch per world size:
    each dispatch of WORLDS at it, {path: (tokens, logprobs, num_ranks)},
    and at 2 ("dp", 2): batch_each's dp batch of test_dataparallel."""

    def get(mode, nranks):
        if nranks not in _RING:
            runs = {d: generated(d, "masked", MAX_TOKENS, CHECKPOINTS) for d, n in WORLDS if n == nranks}
            if nranks == 2:
                runs["dp"] = batch_run("dp", "masked", [DP_MAX_TOKENS], 3, 2048, DP_ARCHS)
            made = {m: make(checkpoint, tmp_path_factory) for m, make in runs.items()}
            proc = launch_several(nranks, [step for step, _ in made.values()], env=RING)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "[ring] Rank 0 accepting" in proc.stderr, proc.stderr[-2000:]
            _RING[nranks] = {m: read(got) for (m, (_, read)), got in zip(made.items(), last_json(proc.stdout)["steps"])}
        return _RING[nranks][mode]

    return get


@pytest.mark.parametrize("dispatch,nranks", WORLDS)
def test_exact_modes_over_ring_equal_mlx_lm(checkpoint, over_ring, dispatch, nranks):
    runs = over_ring(dispatch, nranks)
    for arch, bits in CHECKPOINTS:
        path = checkpoint(arch, bits)
        ref_tokens, ref_logprobs = exact_reference(path)
        tokens, logprobs, num_ranks = runs[str(path)]
        assert num_ranks == nranks
        assert tokens == ref_tokens, (arch, bits)
        assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0, (arch, bits)


def test_dp_over_ring_within_its_tolerance(over_ring):
    got = over_ring("dp", 2)
    for path, result in got.items():
        ref_tokens, ref_logprobs = dp_reference(path, len(DP_MAX_TOKENS))
        assert result["strategy"] == "dp"
        assert result["tokens"] == ref_tokens
        worst = max(abs(a - b) for g, r in zip(result["logprobs"], ref_logprobs) for a, b in zip(g, r))
        assert worst <= DP_TOLERANCE


def test_jaccl_is_refused_in_one_line_without_rdma(checkpoint, tmp_path):
    """This MLX (Linux) has no JACCL: refused in one line, before any model loads."""
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps([[None, "rdma_en3"], ["rdma_en3", None]]))
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", "2", "--backend", "jaccl"],
                  env={"MLXDIST_JACCL_DEVICES": str(devices)})
    lines = error_lines(proc.stderr)
    assert proc.returncode != 0
    assert len(lines) == 1 and "jaccl backend needs MLX's RDMA support" in lines[0], proc.stderr[-2000:]


def test_jaccl_environment_is_what_mlx_launch_builds(tmp_path):
    """The device file read from an mlx.distributed_config hostfile (written
    by MLX's own Hostfile class) holds what mlx.launch's jaccl launch puts in
    MLX_IBV_DEVICES; malformed files are refused in one line."""
    from mlx._distributed_utils.common import Host, Hostfile

    from mlxdist.runtime.backends import jaccl_environment, read_devices

    rdma = [[None, "rdma_en5", "rdma_en4"], ["rdma_en5", None, "rdma_en3"], ["rdma_en4", "rdma_en3", None]]
    hosts = Hostfile([Host(i, f"mac{i}", [f"10.0.0.{i + 1}"], r) for i, r in enumerate(rdma)], backend="jaccl")
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts.to_json()))
    devices = read_devices(str(path), 3)
    env = jaccl_environment(1, devices, "10.0.0.1:5000")
    assert env == {"MLX_IBV_DEVICES": json.dumps([h.rdma for h in hosts.hosts]),
                   "MLX_JACCL_COORDINATOR": "10.0.0.1:5000", "MLX_RANK": "1"}
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps(rdma))
    assert read_devices(str(matrix), 3) == rdma
    for bad, says in [(rdma[:2], "needs 3 rows of 3"), ([["x", "a", "b"], *rdma[1:]], "diagonal"),
                      ([[None, None, "a"], *rdma[1:]], "no RDMA device from rank 0 to rank 1")]:
        matrix.write_text(json.dumps(bad))
        with pytest.raises(RuntimeError, match=says):
            read_devices(str(matrix), 3)
    matrix.write_text('[[null, "rdma_en5"')  # read as every JSON input is (inputs/json_input.py)
    with pytest.raises(RuntimeError, match="MLXDIST_JACCL_DEVICES file .* is not JSON: Expecting"):
        read_devices(str(matrix), 3)


def test_ring_hostfile_is_loopback_on_one_host_else_each_address():
    from mlxdist.runtime.backends import ring_hosts

    assert ring_hosts([("a", "10.0.0.1", 5000), ("a", "10.0.0.1", 5001)]) == [["127.0.0.1:5000"], ["127.0.0.1:5001"]]
    assert ring_hosts([("a", "10.0.0.1", 5000), ("b", "10.0.0.2", 6000)]) == [["10.0.0.1:5000"], ["10.0.0.2:6000"]]


class LaunchedServer(Server):
    """The server under ``mlx.launch --backend ring -n 2`` instead of mpirun."""

    def command(self, path, nranks, extra):
        return [MLX_LAUNCH, "--backend", "ring", "-n", str(nranks), "--", sys.executable, "-m", "mlxdist.serve",
                "--model", str(path), "--port", "0", "--api-key", KEY, *map(str, extra)]

    NOT_RANKS = ("mlx.launch", "bash")


def test_server_under_mlx_launch_answers_as_mlx_lm(checkpoint):
    path = checkpoint("qwen3_moe")
    server = LaunchedServer(path)
    try:
        assert len(server.ranks()) == 2
        for prompt, n in (("Request 3: tokens tokens", 10), ("Hello", 6)):
            body = completion(server, prompt, max_tokens=n)
            assert body["choices"][0]["text"] == alone(path, prompt, n)
            assert body["usage"]["completion_tokens"] == n
    finally:
        code = server.stop()  # Ctrl-C to rank 0, as under mpirun
    assert code == 0, server.proc.stderr.read()[-3000:]
