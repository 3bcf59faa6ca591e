"""Open MPI's session folders (runtime/launcher.py). An mpirun killed with
SIGKILL leaves its rendezvous files in ``$TMPDIR/ompi.<its pid>/`` (a daemon
on another host, in ``prted.<its pid>/``), and Open MPI 5.0 then fails a
later one that the pid comes round to: "The PMIx server's listener thread
failed to start", status 213, before any rank runs. Every launch of
mlxdist's keeps its sessions in a folder of its own, removed after it:
``launch/mpirun``; ``relaunch.Launch`` (the front and ``supervise``);
``own_session`` (the benchmarks); the tests' ``mpirun_env``. Here each starts
in a TMPDIR where a killed one's leftovers wait for every pid it may get."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPIRUN, ROOT, kill_session, launch, mpirun_env
from mlxdist.cli.relaunch import Launch
from mlxdist.runtime.launcher import SESSION_VARIABLES, own_session

pytestmark = pytest.mark.skipif(not Path("/proc/sys/kernel/ns_last_pid").exists(),
                                reason="pids to come are read from Linux's /proc")

LAUNCHER_FAILURE = "The PMIx server's listener thread failed to start"
AHEAD = 4000  # pids covered past the last one given: a launch starts well within them
PRINT_LAUNCHER = ["-c", "import os; print(os.getppid())"]  # a rank's parent: its host's mpirun or daemon
PRINT_RANK_LAUNCHER = ["-c", "import os; print(os.environ['OMPI_COMM_WORLD_RANK'], os.getppid())"]


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
    os.rmdir(env[SESSION_VARIABLES[0]])
    return {**{k: v for k, v in env.items() if k not in SESSION_VARIABLES}, "TMPDIR": str(tmp)}


def _leave_for_next_pids(tmp: Path, leftover, tool: str = "ompi", hosts=None) -> set:
    """The killed mpirun's file (``tool`` "ompi"), or a killed daemon's on
    each of ``hosts`` ("prted"), in ``tmp``'s session folder of each of the
    next ``AHEAD`` pids; those pids."""
    name, data = leftover
    names = [name] if hosts is None else [f"pmix.{host}.tool" for host in hosts]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    pids = {(last + i) % pid_max for i in range(1, AHEAD + 1)}
    for pid in pids:
        folder = tmp / f"{tool}.{pid}"
        folder.mkdir(exist_ok=True)
        for each in names:
            (folder / each).write_bytes(data)
    return pids


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
    """Its session in its launch folder (where rank 0's stdin is), gone after."""
    pids = _leave_for_next_pids(tmp_path, leftover)
    where = ("import os; folder = os.path.dirname(os.environ['MLXDIST_STDIN']); "
             "print(os.getppid(), folder, os.path.isdir(f'{folder}/ompi.{os.getppid()}'))")
    proc = subprocess.run([str(ROOT / "launch/mpirun"), "-np", "2", sys.executable, "-c", where],
                          env=_bare_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line.split() for line in proc.stdout.splitlines()]
    assert len(said) == 2 and all(int(pid) in pids and ours == "True" for pid, _, ours in said), said
    assert not Path(said[0][1]).exists()


def test_the_front_and_supervise_launch_starts_among_leftovers(tmp_path, leftover):
    """relaunch.Launch, which the front and supervise start their jobs with,
    also after its job is killed (as they end a job that lost a rank)."""
    pids = _leave_for_next_pids(tmp_path, leftover)
    started = Launch([MPIRUN, "-np", "2", sys.executable, *PRINT_LAUNCHER], _bare_env(tmp_path), lambda line: None,
                     stdout=subprocess.PIPE)
    assert started.wait() == 0, started.text()[-3000:]
    assert {int(line) for line in started.proc.stdout.read().split()} <= pids
    assert not Path(started.session_base).exists()

    pids = _leave_for_next_pids(tmp_path, leftover)
    killed = Launch([MPIRUN, "-np", "2", sys.executable, "-c", "import os, time; print(os.getppid()); time.sleep(60)"],
                    _bare_env(tmp_path), lambda line: None, stdout=subprocess.PIPE)
    assert int(killed.proc.stdout.readline()) in pids
    os.kill(killed.proc.pid, signal.SIGSTOP)  # a launcher that does not end the job itself
    killed.end(0.5)
    assert killed.proc.returncode == -signal.SIGKILL
    assert not Path(killed.session_base).exists()


def test_the_benchmarks_and_the_tests_launches_start_among_leftovers(tmp_path, leftover):
    pids = _leave_for_next_pids(tmp_path, leftover)
    with own_session(_bare_env(tmp_path)) as env:
        proc = subprocess.run([MPIRUN, "-np", "2", sys.executable, *PRINT_LAUNCHER], env=env, capture_output=True,
                              text=True, timeout=120)
        base = Path(env[SESSION_VARIABLES[0]])
        assert base.is_dir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {int(line) for line in proc.stdout.split()} <= pids
    assert not base.exists()

    pids = _leave_for_next_pids(tmp_path, leftover)
    proc = launch(2, PRINT_LAUNCHER, module=None, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {int(line) for line in proc.stdout.split()} <= pids


def test_daemons_on_other_hosts_start_among_leftovers(tmp_path, leftover, hosts):
    """A launch across the namespace hosts, whose daemons (prted on host1 and
    host2) would get pids a killed daemon of theirs left its files for."""
    pids = _leave_for_next_pids(tmp_path, leftover, "prted", [hosts.names[1], hosts.names[2]])
    proc = hosts.mpirun([0, 1, 2], PRINT_RANK_LAUNCHER, module=None, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    daemons = {int(pid) for rank, pid in (line.split() for line in proc.stdout.splitlines()) if rank != "0"}
    assert len(daemons) == 2 and daemons <= pids


def test_a_bare_launch_across_hosts_fails_among_daemons_leftovers(tmp_path, leftover, hosts):
    _leave_for_next_pids(tmp_path, leftover, "prted", [hosts.names[1], hosts.names[2]])
    env = {"TMPDIR": str(tmp_path), **{name: None for name in SESSION_VARIABLES}}
    proc = hosts.mpirun([0, 1, 2], PRINT_LAUNCHER, module=None, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 213 and "A daemon failed to report back" in said, said[-3000:]
