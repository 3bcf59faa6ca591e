"""A short run of ``python -m mlxdist.bench stress`` under real mpirun
(np = 2): a few hundred mixed requests (normal, streamed and dropped,
malformed, slow, oversized), every answer checked (normal ones against
mlx-lm alone), every rank alive, RSS within its bound, no traceback, the
server answering and stopping cleanly at the end. The full run is
``--requests 10000`` (docs/serving.md#stress)."""

import json
import subprocess
import sys

from conftest import ROOT, mpirun_env


def test_a_short_stress_run(checkpoint, tmp_path):
    out = tmp_path / "stress.json"
    proc = subprocess.run([sys.executable, "-m", "mlxdist.bench", "stress", "--model", str(checkpoint("qwen3_moe")),
                           "--ranks", "2", "--requests", "300", "--clients", "12", "--max-seconds", "240",
                           "--out", str(out)], env=mpirun_env(), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and proc.returncode == 0, "\n".join([json.dumps(report["checks"]),
                                                                 json.dumps(report["failures"][:5]),
                                                                 report["stderr_tail"][-2000:]])
    assert report["requests"] == 300 and all(report["kinds"].get(k) for k in
                                             ("normal", "stream", "dropped", "malformed", "slow", "oversized"))
