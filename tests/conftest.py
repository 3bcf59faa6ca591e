"""Shared fixtures: checkpoints written by mlxdist.synth, and a launcher that
runs mlxdist for real under mpirun on localhost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = str(Path(sys.executable).parent / "mpirun")
if not os.path.exists(MPIRUN):
    MPIRUN = "mpirun"


def mpirun_env() -> dict:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    return env


def launch(np_: int, args, timeout: float = 120, input: str = None, module: str = "mlxdist.run"):
    """Run ``python -m module args`` on ``np_`` ranks (no mpirun for np_ = 0)."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if np_ > 0:
        cmd = [MPIRUN, "-np", str(np_), "--oversubscribe", "--bind-to", "none", *cmd]
    return subprocess.run(
        cmd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=mpirun_env(),
        cwd=ROOT,
    )


def last_json(stdout: str) -> dict:
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    assert lines, f"no JSON in output:\n{stdout}"
    return json.loads(lines[-1])


_CHECKPOINTS = {}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, bits=None) -> path, written once per session."""
    from mlxdist.synth import write_checkpoint

    def get(preset: str, bits=None, **kw) -> Path:
        key = (preset, bits, tuple(sorted(kw.items())))
        if key not in _CHECKPOINTS:
            path = tmp_path_factory.mktemp(f"{preset}-{bits or 'f32'}")
            _CHECKPOINTS[key] = write_checkpoint(path, preset, quantize_bits=bits, **kw)
        return _CHECKPOINTS[key]

    return get
