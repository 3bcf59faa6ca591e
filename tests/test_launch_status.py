"""``launch/mlx-launch`` and ``python -m mlxdist.launch`` (mlxdist/cli/launch.py):
real ``mlx.launch`` on localhost, whose own status is 0 whatever its ranks did; the
wrapper's is the first failed rank's."""

import subprocess
import sys

from conftest import ROOT, mpirun_env

RANK = "import os, sys, time; rank = int(os.environ['MLX_RANK']); "


def _launch(code, *, script=True, timeout=120):
    from mlxdist.runtime.backends import free_port

    cmd = [str(ROOT / "launch/mlx-launch")] if script else [sys.executable, "-m", "mlxdist.launch"]
    return subprocess.run([*cmd, "--backend", "ring", "-n", "2", "--starting-port", str(free_port()), "--",
                           sys.executable, "-c", RANK + code],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=mpirun_env())


def test_a_rank_that_exits_3_is_the_job_status(tmp_path):
    done = tmp_path / "rank0-done"  # rank 1 fails once rank 0 has printed (mlx.launch then stops the others)
    proc = _launch(f"import pathlib; done = pathlib.Path({str(done)!r}); print('out', rank, flush=True)\n"
                   f"if rank == 0: done.touch()\n"
                   f"while rank == 1 and not done.exists(): time.sleep(0.05)\n"
                   f"sys.exit(3 if rank == 1 else 0)")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Node with rank 1 exited with code 3" in proc.stderr  # mlx.launch's own lines pass through
    assert sorted(proc.stdout.split("\n")[:2]) == ["out 0", "out 1"], proc.stdout


def test_the_first_failure_not_the_ranks_stopped_after_it():
    """Rank 0 fails with 5 at once; mlx.launch then stops rank 1 (SIGTERM: 143 in a shell): the job's status is 5."""
    proc = _launch("time.sleep(0 if rank == 0 else 60); sys.exit(5)", script=False)
    assert proc.returncode == 5, proc.stderr[-2000:]


def test_ranks_that_succeed_give_0():
    proc = _launch("pass", script=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_report_lines_are_read_in_order():
    from mlxdist.cli.launch import KILLED, failures, job_status

    text = ("\x1b[33m[WARN] Node with rank 2 exited with code -9 \x1b[0m\nnoise\n"
            "\x1b[33m[WARN] Node with rank 0 was killed \x1b[0m\n[WARN] Node with rank 1 exited with code 3\n")
    assert failures(text) == [(2, 137), (0, KILLED), (1, 3)]
    assert job_status(failures(text), 0) == 137
    assert job_status([(0, KILLED)], 0) == 1
    assert job_status([], 2) == 2
