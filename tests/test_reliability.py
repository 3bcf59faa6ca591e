"""Reliability under real mpirun: a rank that dies or hangs ends the job
within seconds with a report of who stopped and during what; ranks that
loaded different things are refused at LOAD; corrupt files give one line
naming the file; a long run stays exact and flat in memory."""

import shutil
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, ROOT, error_lines, last_json, launch, mpirun_env


def run_with_fault(path, fault, dispatch, timeout_flag=None, nranks=3):
    env_fault = {"MLXDIST_FAULT": fault}
    args = ["--model", path, "--prompt", "a fault is coming", "-m", 12, "--mode", dispatch]
    if timeout_flag:
        args += ["--timeout", timeout_flag]
    tic = time.time()
    proc = launch(nranks, args, timeout=90, env=env_fault)
    return proc, time.time() - tic


@pytest.mark.parametrize("dispatch", ["p2p", "collective"])
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_dies(checkpoint, dispatch, victim):
    path = checkpoint("qwen3_moe")
    proc, elapsed = run_with_fault(path, f"kill:rank={victim},layer=1,step=3", dispatch)
    assert proc.returncode != 0
    assert elapsed < 30
    reports = error_lines(proc.stderr, "mlxdist: error: rank")
    assert reports, proc.stderr
    assert all(f"rank {victim} stopped (process gone)" in l for l in reports), reports
    assert all("step 3" in l for l in reports), reports
    survivor = 0 if victim != 0 else 1
    assert any(l.startswith(f"mlxdist: error: rank {survivor}:") for l in reports)


SLOW_STEPS = {1: 1.5, 5: 0.6}  # step -> seconds rank 1 sleeps at each of its MoE layers (2 layers)


@pytest.fixture(scope="module")
def slow_runs(checkpoint):
    """slow_runs(dispatch): one run at --timeout 2 whose rank 1 is slow at
    both steps of SLOW_STEPS, launched once per dispatch."""
    runs = {}

    def get(dispatch):
        if dispatch not in runs:
            fault = ";".join(f"sleep:rank=1,layer=-1,step={step},seconds={seconds}"
                             for step, seconds in SLOW_STEPS.items())
            runs[dispatch], _ = run_with_fault(checkpoint("qwen3_moe"), fault, dispatch, "2", nranks=2)
        return runs[dispatch]

    return get


@pytest.mark.parametrize("dispatch", ["p2p", "collective"])
@pytest.mark.parametrize("step", SLOW_STEPS, ids=["prefill-over-timeout", "decode-under-timeout"])
def test_slow_work_is_not_a_hang(slow_runs, dispatch, step):
    """Progress is finished work: a decode step slower than usual but under
    the timeout (step 5: 1.2 s), and a prefill longer than the timeout
    (step 1: 3 s; one long evaluation; prefills get PREFILL_FACTOR x the
    timeout) are not reported. Both slow steps are in one run per dispatch."""
    proc = slow_runs(dispatch)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no progress" not in proc.stderr


@pytest.mark.parametrize("dispatch", ["p2p", "collective"])
def test_a_rank_hangs(checkpoint, dispatch):
    path = checkpoint("qwen3_moe")
    proc, elapsed = run_with_fault(path, "sleep:rank=2,layer=1,step=3,seconds=600", dispatch, "3")
    assert proc.returncode != 0
    assert elapsed < 30
    reports = error_lines(proc.stderr, "mlxdist: error: rank")
    assert any(
        l.startswith("mlxdist: error: rank 2: no progress for 3 s while computing its experts during layer 1 of step 3")
        for l in reports
    ), proc.stderr
    if dispatch == "p2p":  # rank 0 knows exactly whose reply it is missing
        assert any("rank 0: no progress for 3 s while waiting in the expert exchange during layer 1 of step 3 on rank 2" in l
                   for l in reports), reports


def _mpmd(contexts, timeout=90):
    """mpirun with one app context per (wdir, argv) pair, one rank each."""
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "--stdin", "none"]
    for i, (wdir, argv) in enumerate(contexts):
        if i:
            cmd.append(":")
        cmd += ["-np", "1", "--wdir", str(wdir), sys.executable, *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpirun_env())


def _one_error(proc) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = error_lines(proc.stderr, "mlxdist: error:")
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_ranks_with_different_checkpoints_are_refused(checkpoint, tmp_path):
    for sub, (arch, bits) in {"a": ("qwen3_moe", None), "b": ("qwen3_moe", 4)}.items():
        (tmp_path / sub).mkdir()
        shutil.copytree(checkpoint(arch, bits), tmp_path / sub / "model")
    argv = ["-m", "mlxdist.run", "--model", "model", "--prompt", "hi"]
    proc = _mpmd([(tmp_path / "a", argv), (tmp_path / "b", argv), (tmp_path / "a", argv)])
    line = _one_error(proc)
    assert "rank 1 (checkpoint file config.json, checkpoint file model.safetensors" in line
    assert "rank 2" not in line


def test_ranks_with_checkpoints_of_equal_shapes_but_other_weights_are_refused(checkpoint, tmp_path):
    """Two random checkpoints of identical shapes (other seeds) under one path."""
    from mlxdist.synth import write_checkpoint

    for sub, seed in {"a": 0, "b": 1}.items():
        write_checkpoint(tmp_path / sub / "model", "qwen3_moe", seed=seed)
    argv = ["-m", "mlxdist.run", "--model", "model", "--prompt", "hi"]
    line = _one_error(_mpmd([(tmp_path / "a", argv), (tmp_path / "b", argv), (tmp_path / "a", argv)]))
    assert "rank 1 (checkpoint file model.safetensors)" in line
    assert "rank 2" not in line


def test_ranks_with_different_mlxdist_versions_are_refused(checkpoint):
    args = ["--model", checkpoint("qwen3_moe"), "--prompt", "hi"]
    patched = ["-c", "import sys, mlxdist; mlxdist.__version__ = '0.0.0-other'; "
               "from mlxdist.run import main; sys.exit(main())"]
    proc = _mpmd([(ROOT, ["-m", "mlxdist.run", *args]), (ROOT, [*patched, *args])])
    assert "rank 1 (mlxdist version)" in _one_error(proc)


def _corrupt_copy(checkpoint, tmp_path, name, corrupt):
    path = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3_moe"), path)
    corrupt(path / name)
    return path


@pytest.mark.parametrize(
    "name,corrupt,message",
    [
        ("model.safetensors", lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "model.safetensors is truncated"),
        ("config.json", lambda f: f.write_text("{ not json"), "config.json is not valid JSON"),
        ("tokenizer.json", lambda f: f.write_text('{"version": "1.0", "model": 42}'), "tokenizer"),
    ],
)
def test_corrupt_files_name_the_file(checkpoint, tmp_path, name, corrupt, message):
    path = _corrupt_copy(checkpoint, tmp_path, name, corrupt)
    line = _one_error(launch(2, ["--model", path, "--prompt", "hi"], timeout=90))
    assert message in line and str(path) in line


SOAK_CALLS = {"masked": 100, "compact": 80}  # collective layout -> generate calls


@pytest.fixture(scope="module")
def soak(checkpoint):
    """One launch soaking both layouts in turn (tests/scripts/soak.py), and
    mlx-lm's 16 greedy tokens for each of its prompts."""
    from test_jobs import mlx_lm_greedy

    path = checkpoint("qwen3_moe")
    proc = launch(2, [ROOT / "tests/scripts/soak.py", path, *(f"{l}:{n}" for l, n in SOAK_CALLS.items())],
                  module=None, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    return out, dict(enumerate(mlx_lm_greedy(path, out["prompts"], 16, raw=True)))


@pytest.mark.parametrize("layout", SOAK_CALLS)
def test_soak_is_exact_and_flat(soak, layout):
    """Short generations alternating with stats calls (mpi4py on the main
    thread right after MLX's collectives on its worker thread: the race
    that once crashed a rank), in both collective layouts."""
    out, longest = soak
    run = out[layout]
    assert len(run["calls"]) == SOAK_CALLS[layout]
    for prompt, max_tokens, tokens in run["calls"]:
        assert tokens == longest[prompt][:max_tokens]
    for after_10, after_all in zip(run["rss_after_10"], run["rss_after_all"]):
        assert after_all <= 1.05 * after_10


def test_a_script_that_fails_ends_every_rank(checkpoint):
    """An unexpected exception in rank 0's script ends the job at once, with
    its traceback and one line, instead of leaving the other ranks waiting."""
    tic = time.time()
    proc = launch(2, [ROOT / "tests/scripts/raises.py", checkpoint("qwen3_moe")], module=None, timeout=90)
    assert proc.returncode != 0
    assert time.time() - tic < 30
    assert "mlxdist: error: rank 0: RuntimeError: the script failed" in proc.stderr


def test_mpi_allows_threads_and_control_has_its_own_communicator():
    """Also: with nothing set, every rank starts MPI without Open MPI's
    libfabric layer (docs/notes/openmpi-start.md)."""
    proc = launch(2, ["-c", (
        "import os; from mlxdist.runtime.world import init_world; w = init_world('mpi'); from mpi4py import MPI; "
        "print(MPI.Query_thread() >= MPI.THREAD_SERIALIZED, MPI.Comm.Compare(w.comm, MPI.COMM_WORLD) == MPI.CONGRUENT, "
        "os.environ['OMPI_MCA_btl'])")],
        module=None, timeout=60, env={"OMPI_MCA_btl": None})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "^ofi"] * 2


def test_exit_status_survives_finalize():
    """The process ends with the script's status after MPI is finalized once."""
    script = "import sys, mlxdist\nwith mlxdist.init() as cluster:\n    sys.exit(3)\n"
    proc = launch(2, ["-c", script], module=None, timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "MPI_Finalize" not in proc.stderr


@pytest.mark.parametrize("dispatch", ["p2p", "collective"])
def test_an_unexpected_error_keeps_its_traceback(checkpoint, tmp_path, dispatch):
    """One line on stderr naming the rank and where the traceback went; the
    file has it."""
    env = {"MLXDIST_FAULT": "raise:rank=1,layer=1,step=2", "MLXDIST_LOG_DIR": str(tmp_path),
           "MLXDIST_AGREE_SECONDS": "1"}  # rank 0 never says it failed too: the wait for it is all slack
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--prompt", "a fault is coming", "-m", 8,
                      "--mode", dispatch], timeout=90, env=env)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr, "mlxdist: error: rank 1: RuntimeError")
    assert lines, [l for l in proc.stderr.splitlines() if "RuntimeError" in l]
    line = lines[0]
    assert "injected fault at layer 1 of step 2 (traceback: " in line
    path = line.split("(traceback: ")[1].rstrip(")")
    text = open(path).read()
    assert "Traceback (most recent call last)" in text and "maybe_fire" in text
    assert "Traceback" not in proc.stderr  # stderr keeps its one line
