"""Open MPI's session folder (runtime/launcher.py). An mpirun killed with
SIGKILL leaves its rendezvous files in ``$TMPDIR/ompi.<its pid>/``, and
Open MPI 5.0 then fails a later mpirun that the pid comes round to: "The
PMIx server's listener thread failed to start", status 213, before any rank
runs. Every launch of mlxdist's keeps its session in a folder of its own,
removed after it: ``launch/mpirun``; ``relaunch.Launch`` (the front and
``supervise``); ``own_session`` (the benchmark); the tests' ``mpirun_env``.
Here each starts in a TMPDIR where a killed mpirun's leftovers wait for
every pid it may get."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import MPIRUN, ROOT, kill_session, launch, mpirun_env
from mlxdist.cli.relaunch import Launch
from mlxdist.runtime.launcher import SESSION_BASE, own_session

pytestmark = pytest.mark.skipif(not Path("/proc/sys/kernel/ns_last_pid").exists(),
                                reason="pids to come are read from Linux's /proc")

LAUNCHER_FAILURE = "The PMIx server's listener thread failed to start"
AHEAD = 4000  # pids covered past the last one given: a launch starts well within them
PRINT_LAUNCHER = ["-c", "import os; print(os.getppid())"]  # a rank's parent is the local mpirun


@pytest.fixture(scope="module")
def leftover(tmp_path_factory):
    """(name, bytes) of the session tool file a real mpirun, SIGKILLed, left."""
    tmp = tmp_path_factory.mktemp("killed")
    proc = subprocess.Popen([MPIRUN, "-np", "1", "sleep", "60"], env=_bare_env(tmp), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = tmp / f"ompi.{proc.pid}"
    deadline = time.time() + 60
    while time.time() < deadline and not list(folder.glob("pmix.*.tool")):
        time.sleep(0.05)
    kill_session(proc.pid)
    proc.wait()
    found = list(folder.glob("pmix.*.tool"))
    assert found, f"mpirun wrote no session tool file in {folder}"
    return found[0].name, found[0].read_bytes()


def _bare_env(tmp: Path) -> dict:
    """The tests' environment for a launch, with Open MPI's session where a
    bare mpirun keeps it: in ``tmp`` (as TMPDIR)."""
    env = mpirun_env()
    os.rmdir(env.pop(SESSION_BASE))
    return {**env, "TMPDIR": str(tmp)}


def _leave_for_next_pids(tmp: Path, leftover) -> set:
    """The killed mpirun's file in ``tmp``'s session folder of each of the
    next ``AHEAD`` pids; those pids."""
    name, data = leftover
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    pids = {(last + i) % pid_max for i in range(1, AHEAD + 1)}
    for pid in pids:
        folder = tmp / f"ompi.{pid}"
        folder.mkdir(exist_ok=True)
        (folder / name).write_bytes(data)
    return pids


def _launch_folders(tmp: Path) -> list:
    return sorted(p.name for p in tmp.glob("mlxdist-launch.*"))


def test_a_killed_mpiruns_leftovers_fail_a_bare_mpirun(tmp_path, leftover):
    """The fact the rest answers: Open MPI 5.0.11 (PMIx 5.0) will not write
    over a leftover session tool file. Where this fails, Open MPI reclaims
    them itself (PMIx's later releases do) and the folders are a spare."""
    pids = _leave_for_next_pids(tmp_path, leftover)
    proc = subprocess.Popen([MPIRUN, "-np", "1", "true"], env=_bare_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    said = proc.communicate(timeout=60)[1]
    assert proc.pid in pids
    assert proc.returncode == 213 and LAUNCHER_FAILURE in said, (proc.returncode, said[-2000:])


def test_launch_mpirun_starts_among_leftovers(tmp_path, leftover):
    pids = _leave_for_next_pids(tmp_path, leftover)
    proc = subprocess.run([str(ROOT / "launch/mpirun"), "-np", "2", sys.executable, *PRINT_LAUNCHER],
                          env=_bare_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {int(line) for line in proc.stdout.split()} <= pids  # its mpirun had a leftover's pid
    assert _launch_folders(tmp_path) == []


def test_the_front_and_supervise_launch_starts_among_leftovers(tmp_path, leftover, monkeypatch):
    """relaunch.Launch, which the front and supervise start their jobs with,
    also after its job is killed (as they end a job that lost a rank)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pids = _leave_for_next_pids(tmp_path, leftover)
    started = Launch([MPIRUN, "-np", "2", sys.executable, *PRINT_LAUNCHER], _bare_env(tmp_path), lambda line: None,
                     stdout=subprocess.PIPE)
    assert started.wait() == 0, started.text()[-3000:]
    assert {int(line) for line in started.proc.stdout.read().split()} <= pids
    assert _launch_folders(tmp_path) == []

    pids = _leave_for_next_pids(tmp_path, leftover)
    killed = Launch([MPIRUN, "-np", "2", sys.executable, "-c", "import os, time; print(os.getppid()); time.sleep(60)"],
                    _bare_env(tmp_path), lambda line: None, stdout=subprocess.PIPE)
    assert int(killed.proc.stdout.readline()) in pids
    os.kill(killed.proc.pid, signal.SIGSTOP)  # a launcher that does not end the job itself
    killed.end(0.5)
    assert killed.proc.returncode == -signal.SIGKILL
    assert _launch_folders(tmp_path) == []


def test_the_benchmarks_and_the_tests_launches_start_among_leftovers(tmp_path, leftover):
    pids = _leave_for_next_pids(tmp_path, leftover)
    with own_session(_bare_env(tmp_path)) as env:
        proc = subprocess.run([MPIRUN, "-np", "2", sys.executable, *PRINT_LAUNCHER], env=env, capture_output=True,
                              text=True, timeout=120)
        assert Path(env[SESSION_BASE]).is_dir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {int(line) for line in proc.stdout.split()} <= pids
    assert not Path(env[SESSION_BASE]).exists()

    pids = _leave_for_next_pids(tmp_path, leftover)
    proc = launch(2, PRINT_LAUNCHER, module=None, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {int(line) for line in proc.stdout.split()} <= pids
