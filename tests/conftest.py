"""Shared fixtures: checkpoints written by mlxdist.synth, and a launcher that
runs mlxdist for real under mpirun on localhost."""

import atexit
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The suite's own start-up measure (tests/startup/transformers_index.py): in this process, before
# anything imports mlx-lm, and, through PYTHONPATH, in every process the tests start.
STARTUP = str(ROOT / "tests" / "startup")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [STARTUP, os.environ.get("PYTHONPATH")] if p)
sys.path.insert(0, STARTUP)
import transformers_index  # noqa: E402

transformers_index.install()

from mlxdist import envs  # noqa: E402
from mlxdist.runtime.launcher import new_session_base, session_env  # noqa: E402

MPIRUN = str(Path(sys.executable).parent / "mpirun")
if not os.path.exists(MPIRUN):
    MPIRUN = "mpirun"


def interruptible() -> None:
    """A child's ``preexec_fn``: SIGINT back to its default, as at a terminal.
    A shell's background job (``launch/test &``, some CI runners) starts with
    SIGINT ignored, which every child inherits, and then Ctrl-C tests would
    test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# The Open MPI session folders of this process's launches (runtime/launcher.py: a killed mpirun's
# or daemon's leftovers fail a later one of the same pid), removed as it ends. The namespace
# hosts share this file system, so their daemons' sessions are in there too.
_SESSIONS = tempfile.mkdtemp(prefix="mlxdist-tests.")
atexit.register(shutil.rmtree, _SESSIONS, True)


def mpirun_env() -> dict:
    """This environment with what a test's launch needs, a session folder of
    its own among them (a new one each call: one launch's)."""
    env = dict(os.environ)
    env.update(
        **session_env(new_session_base(_SESSIONS)),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        **envs.mpi_start_defaults(env),  # as mlxdist's ranks start MPI, for scripts that start it themselves
        # auto's choices asserted here are its rule on one host's link: ranks sharing this box's
        # cores with other jobs measure their link anywhere from 10 us to milliseconds a collective.
        # Tests of the measurement set "measure" (test_auto_link.py).
        MLXDIST_AUTO_LINK=env.get("MLXDIST_AUTO_LINK", "local"),
        # Tests that measure the link measure it at every load, whatever an earlier test stored
        # (test_decision.py, which tests the stored decision, sets 0).
        MLXDIST_REMEASURE=env.get("MLXDIST_REMEASURE", "1"),
        # Up to eight ranks of two tests share two cores: the scheduler alone can hold a rank's
        # heartbeat thread past the default 5 s, which ends the launch ("rank 0 ... lost").
        # Tests of the heartbeat give --heartbeat (or init's) themselves.
        MLXDIST_HEARTBEAT=env.get("MLXDIST_HEARTBEAT", "30"),
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    return env


def launch(np_: int, args, timeout: float = 120, input: str = None, module: str = "mlxdist.run", env: dict = None,
           mpirun_args=()):
    """Run ``python -m module args`` (a script where module is None) on
    ``np_`` ranks (no mpirun for np_ = 0), with ``env`` over ``mpirun_env()``
    (a value None unsets the variable)."""
    cmd = [sys.executable, *(["-m", module] if module else []), *map(str, args)]
    env = {k: v for k, v in {**mpirun_env(), **(env or {})}.items() if v is not None}  # None: unset
    if np_ > 0:
        cmd = [MPIRUN, *mpirun_args, "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--stdin", "none", *cmd]
    if input is None or np_ == 0:
        try:
            return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:  # say what the ranks said before the limit
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd[-12:])}\n{stderr[-4000:]}") from None
    # Open MPI 5 never forwards stdin's EOF: hand rank 0 a FIFO, as launch/mpirun does.
    with tempfile.TemporaryDirectory() as tmp:
        fifo = os.path.join(tmp, "stdin")
        os.mkfifo(fifo)
        env["MLXDIST_STDIN"] = fifo

        def feed():
            with open(fifo, "w") as f:
                f.write(input)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        finally:
            if feeder.is_alive():  # rank 0 never opened it: unblock the writer
                with open(fifo, "r"):
                    pass


@functools.lru_cache(maxsize=None)
def mlx_lm_loaded(path: str):
    """mlx-lm's ``load(path)`` in this process, once per session: the
    references the tests compare with only generate from it."""
    from mlx_lm import load

    return load(path)


def error_lines(stderr: str, start: str = "mlxdist: error") -> list:
    """stderr's lines that start with ``start``; Open MPI's abort output may
    leave NUL bytes before such a line."""
    return [l for l in (line.lstrip("\0") for line in stderr.splitlines()) if l.startswith(start)]


def last_json(stdout: str) -> dict:
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    assert lines, f"no JSON in output:\n{stdout}"
    return json.loads(lines[-1])


# Test modules that start mlx.launch's ring on this host at its default ports (32323 on), which two
# such jobs at once would both take: under xdist they share one worker, one after another.
RING_AT_DEFAULT_PORTS = {"tests/test_backends.py", "tests/test_docs.py", "tests/test_rank0_files.py",
                         "tests/test_shape.py", "tests/test_share.py"}
# The work units that take longest on two cores, longest first: handed out before the others (by
# their number of tests), so that none of them is left to run alone at the end. Speed only.
LONGEST_UNITS = ["tests/shared_launch.py", "mlx.launch at its default ports", "tests/test_reliability.py",
                 "tests/test_recovery.py", "tests/test_models.py", "tests/test_agent_apis.py",
                 "tests/test_default_load.py", "tests/test_front.py", "tests/test_hostile.py", "tests/test_serve.py",
                 "tests/test_heartbeat.py", "tests/test_jobs.py", "tests/test_hosts.py"]
_SHARED_LAUNCH = re.compile(r"^from shared_launch import [^\n]*\bdeclare\b", re.MULTILINE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``--dist loadfile`` (launch/test runs two workers),
    where some files go together: a module runs whole on one worker (its
    module-scoped servers and launches start once), and so do the modules
    that declare tests/shared_launch.py's runs (one such launch holds the
    runs of every module with tests in the worker's session) and those of
    RING_AT_DEFAULT_PORTS. Other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:  # the longest units first, the rest by their number of tests
            first = next((unit for unit in LONGEST_UNITS if unit in self.workqueue), None)
            if first is not None:
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@functools.lru_cache(maxsize=None)
def work_unit(file: str) -> str:
    """The work unit of xdist's scheduler (above) that test file ``file`` belongs to."""
    if file in RING_AT_DEFAULT_PORTS:
        return "mlx.launch at its default ports"
    try:
        declares = bool(_SHARED_LAUNCH.search((ROOT / file).read_text()))
    except OSError:
        declares = False
    return "tests/shared_launch.py" if declares else file


_CHECKPOINTS = {}


@pytest.fixture(scope="session", autouse=True)
def share_cache(tmp_path_factory):
    """Shares the tests' jobs cache go to a folder of this session (a test
    may name its own), never the user's ~/.cache/mlxdist, nor another
    session's running beside it: the synthetic checkpoints of two sessions
    have the same content, so their shares the same key."""
    folder = tmp_path_factory.mktemp("mlxdist-cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MLXDIST_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, bits=None) -> path, written once per session."""
    from mlxdist.synth import write_checkpoint

    def get(preset: str, bits=None, **kw) -> Path:
        key = (preset, bits, json.dumps(kw, sort_keys=True))
        if key not in _CHECKPOINTS:
            path = tmp_path_factory.mktemp(f"{preset}-{bits or 'f32'}")
            _CHECKPOINTS[key] = write_checkpoint(path, preset, quantize_bits=bits, **kw)
        return _CHECKPOINTS[key]

    return get


def kill_session(sid: int) -> None:
    """SIGKILL every process of a session: mpirun puts each rank in its own
    process group, so killing the launcher's group would leave ranks running."""
    import signal

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: the session id
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    """Four hosts made of network namespaces (tests/netns.py), shared by the
    session; skipped, with the reason, where they cannot be made."""
    from netns import Hosts, cannot_make

    reason = cannot_make()
    if reason:
        pytest.skip(f"no namespace hosts: {reason}")
    try:
        made = Hosts(4, tmp_path_factory.mktemp("hosts"))
    except RuntimeError as e:
        pytest.skip(str(e))
    yield made
    made.close()


@pytest.fixture
def hub():
    """A stand-in for the Hugging Face hub on 127.0.0.1 (tests/hubserver.py),
    serving no repo until the test ``add``s one; point a launch at ``hub.url``
    with HF_ENDPOINT."""
    from hubserver import Hub

    made = Hub()
    made.start()
    yield made
    made.stop()
