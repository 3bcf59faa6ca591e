"""Files an option names that may exist on rank 0's host alone
(``serve --api-key-file``, ``run``/``serve --rank-memory HOSTS.json``): rank
0 alone reads them, once the job has started, and its verdict reaches every
rank. A rank that could not read such a file used to exit 0 quietly while
rank 0 waited for it in MPI's start, forever. Each rank sees its own file
system (tests/scripts/rank_view.py hides a folder from some ranks, as
another machine would not have it)."""

import json
import socket
import subprocess
import sys

from conftest import ROOT, error_lines, kill_session, last_json, launch, mpirun_env
from test_backends import MLX_LAUNCH
from test_serve import KEY, Server, alone, completion

VIEW = ROOT / "tests/scripts/rank_view.py"


def rank0_files(tmp_path):
    """A folder holding an API key file and a hostfile of budgets for this host."""
    folder = tmp_path / "on-rank-0"
    folder.mkdir()
    (folder / "key").write_text(KEY + "\n")
    (folder / "hosts.json").write_text(json.dumps([{"ssh": socket.gethostname(), "memory_gb": 1}]))
    return folder


class ViewedServer(Server):
    """``Server``, each rank through rank_view.py with ``view``, the key from ``--api-key-file`` alone."""

    def __init__(self, path, view, extra):
        self.view = [str(v) for v in view]
        try:
            super().__init__(path, extra=extra)
        except RuntimeError:  # it never listened: end its ranks (a session of their own) before failing
            if getattr(self, "proc", None) is not None:
                kill_session(self.proc.pid)
            raise

    def command(self, path, nranks, extra):
        cmd = super().command(path, nranks, extra)
        key = cmd.index("--api-key")
        del cmd[key:key + 2]
        python = cmd.index(sys.executable)
        return cmd[:python] + [sys.executable, str(VIEW), *self.view, "--"] + cmd[python:]


def test_serve_reads_its_files_on_rank_0_alone(checkpoint, tmp_path):
    """The key file and the hostfile are on rank 0's host only: the server
    listens, wants the key, and answers as mlx-lm."""
    path = checkpoint("qwen3_moe")
    files = rank0_files(tmp_path)
    server = ViewedServer(path, ["--hide", files],
                          ["--api-key-file", files / "key", "--rank-memory", files / "hosts.json"])
    try:
        assert server.get("/health", key=None)[0] == 401
        assert completion(server, "Hello")["choices"][0]["text"] == alone(path, "Hello", 8)
    finally:
        assert server.stop() == 0, server.proc.stderr.read()[-3000:]


def test_run_reads_its_hostfile_on_rank_0_alone(checkpoint, tmp_path):
    """Under mpirun and under mlx.launch (ring), --rank-memory's hostfile on
    rank 0's host only: the job runs; on rank 1's host only: every rank ends
    non-zero within seconds, with rank 0's one line."""
    path = checkpoint("tiny")
    files = rank0_files(tmp_path)
    run = [sys.executable, "-m", "mlxdist.run", "--model", path, "-p", "Hello", "-m", 3, "--json",
           "--rank-memory", files / "hosts.json"]
    mlx_launch = [MLX_LAUNCH, "--backend", "ring", "-n", "2", "--"]
    for hidden_on in ("1", "0"):
        view = [VIEW, "--hide", files, "--ranks", hidden_on, "--"]
        by_mpirun = launch(2, [*view, *run], module=None, timeout=60)
        by_mlx_launch = subprocess.run([*mlx_launch, sys.executable, *map(str, view + run)], capture_output=True,
                                       text=True, timeout=60, env=mpirun_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
        for proc in (by_mpirun, by_mlx_launch):
            if hidden_on == "1":
                assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
                assert last_json(proc.stdout)["num_ranks"] == 2
            else:
                lines = error_lines(proc.stderr)
                assert len(lines) == 1 and "hosts.json" in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert by_mpirun.returncode != 0 or hidden_on == "1"
        if hidden_on == "0":  # mlx.launch returns 0 whatever its ranks do, and says how each ended
            assert "rank 0 exited with code 1" in by_mlx_launch.stderr and "rank 1 exited with code 1" in \
                by_mlx_launch.stderr, by_mlx_launch.stderr[-2000:]


def test_serve_refuses_a_key_file_missing_on_rank_0_on_every_rank(tmp_path):
    """The key file on rank 1's host only, under mpirun and mlx.launch: one
    line, every rank exits 2 within seconds (under mlx.launch rank 1 used to
    wait for rank 0 in the ring's start, forever)."""
    files = rank0_files(tmp_path)
    serve = [VIEW, "--hide", files, "--ranks", "0", "--", sys.executable, "-m", "mlxdist.serve", "--port", 0,
             "--api-key-file", files / "key"]
    by_mpirun = launch(2, serve, module=None, timeout=60)
    by_mlx_launch = subprocess.run([MLX_LAUNCH, "--backend", "ring", "-n", "2", "--", sys.executable, *map(str, serve)],
                                   capture_output=True, text=True, timeout=60, env=mpirun_env(), cwd=ROOT,
                                   stdin=subprocess.DEVNULL)
    for proc in (by_mpirun, by_mlx_launch):
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and "--api-key-file" in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert by_mpirun.returncode == 2
    assert "rank 0 exited with code 2" in by_mlx_launch.stderr and "rank 1 exited with code 2" in \
        by_mlx_launch.stderr, by_mlx_launch.stderr[-2000:]
