"""The doctor under real mpirun on one host: each rank's GPU, OS build and
the commit of the mlxdist it runs (two checkouts at two commits are told
apart and warned about), a hub id in no cache is one to be downloaded at
load, and a probe that fails on rank 1 alone (a dangling weight file,
through a mount namespace) ends every rank within seconds with that
rank's line, never a hang."""

import json
import os
import shutil
import subprocess
import sys

from conftest import MPIRUN, ROOT, last_json, launch, mpirun_env

VIEW = ROOT / "tests/scripts/rank_view.py"
PROBLEM = "mlxdist doctor: problem: "


def _lines(stderr: str, kind: str):
    return [line for line in stderr.splitlines() if line.startswith(f"mlxdist doctor: {kind}: ")]


def _checkout_at_another_commit(tmp_path):
    """A git checkout holding this mlxdist package, committed on its own: another commit than ROOT's."""
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "mlxdist", copy / "mlxdist", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(copy), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "mlxdist"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "another"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True)
    return copy, head.stdout.strip()


def test_ranks_report_gpu_os_build_and_the_commit_they_run(tmp_path, checkpoint):
    """Rank 0 runs ROOT's checkout, rank 1 another checkout of the same code
    at another commit (MPMD): their commits differ and are warned about,
    each beside the version; GPU and OS build come from MLX and the OS."""
    copy, commit = _checkout_at_another_commit(tmp_path)
    doctor = ["-m", "mlxdist.doctor", "--json", "--model", str(checkpoint("qwen3_moe"))]
    cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "1", sys.executable, *doctor, ":",
           "-np", "1", "sh", "-c", f'cd {copy} && PYTHONPATH={copy} exec "$0" "$@"', sys.executable, *doctor]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=mpirun_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    import mlx.core as mx

    info = mx.device_info()
    assert [r["gpu"] for r in got["ranks"]] == [f"{info['device_name']} ({info['architecture']})"] * 2
    assert len({r["os_build"] for r in got["ranks"]}) == 1 and os.uname().release in got["ranks"][0]["os_build"]
    commits = [r["commits"]["mlxdist"] for r in got["ranks"]]
    assert commits[1] == commit and commits[0] and commits[0].split("+")[0] != commit, commits
    assert got["warnings"] == [f"mlxdist commits differ: rank 0 {commits[0]}, rank 1 {commit}"]
    assert _lines(proc.stderr, "warning") == [f"mlxdist doctor: warning: {got['warnings'][0]}"]
    assert "mlxdist doctor: ready" in proc.stderr  # a warning is not a problem


def test_differing_os_builds_and_gpus_are_warned_about_with_rdma_named():
    from mlxdist.doctor.report import problems, warnings

    def rank(r, build, gpu):
        return {"rank": r, "os": "macOS 15.3", "os_build": build, "gpu": gpu, "versions": {}, "commits": {},
                "mpi": "x", "threads": "multiple", "available_gb": 80.0, "cache": "/c", "cache_free_gb": 50.0,
                "model": None}

    ranks = [rank(0, "24D70", "Apple M2 Ultra (applegpu_g14d)"), rank(1, "24E248", "Apple M3 Ultra (applegpu_g15d)")]
    found = warnings(ranks)
    assert found[0] == ("macOS builds differ: rank 0 24D70, rank 1 24E248; RDMA over Thunderbolt (--backend jaccl "
                        "or jaccl-ring) needs the same macOS build on every Mac: update them to one")
    assert found[1].startswith("GPUs differ: rank 0 Apple M2 Ultra (applegpu_g14d), rank 1 Apple M3 Ultra")
    addresses = [{"host": {"name": f"h{i}", "addresses": []}, "toward": [None] * 2, "errors": {}} for i in range(2)]
    assert problems(ranks, addresses, [[None] * 2] * 2) == [] and warnings([ranks[0], ranks[0]]) == []


def test_a_hub_id_in_no_cache_will_be_downloaded_at_load(tmp_path):
    """Not a problem (the load downloads it on rank 0): a note, and the
    table says so; with HF_HUB_OFFLINE, where it cannot be, a problem."""
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": None}
    proc = launch(2, ["--model", "org/not-downloaded"], module="mlxdist.doctor", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc.stderr, "problem") == []
    assert _lines(proc.stderr, "note") == ["mlxdist doctor: note: org/not-downloaded is in no rank's hub cache: rank 0 "
                                           "will download it at load"]
    assert proc.stdout.count("will be downloaded at load") == 2
    offline = launch(2, ["--model", "org/not-downloaded", "--json"], module="mlxdist.doctor",
                     env={**env, "HF_HUB_OFFLINE": "1"}, timeout=240)
    assert offline.returncode == 1
    assert json.loads(offline.stdout.splitlines()[-1])["problems"] == [
        "no rank has the model: org/not-downloaded (not in this rank's hub cache); HF_HUB_OFFLINE keeps rank 0 from "
        "downloading it"]


def test_a_probe_failing_on_rank_1_ends_every_rank_with_its_line(tmp_path, checkpoint):
    """Rank 1 sees the model folder with model.safetensors a dangling link
    (a hub snapshot whose blob is gone), then an empty /proc/meminfo: the
    doctor used to print a traceback there and wait forever on rank 0.
    Now: one problem line naming rank 1, no traceback, every rank non-zero."""
    path = checkpoint("qwen3_moe")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    proc = launch(2, [VIEW, "--bind", broken, path, "--", sys.executable, "-m", "mlxdist.doctor", "--model", path],
                  module=None, timeout=120)  # a hang fails here
    assert proc.returncode != 0
    assert _lines(proc.stderr, "problem") == [
        f"{PROBLEM}rank 1 could not be examined: FileNotFoundError: [Errno 2] No such file or directory: "
        f"'{path}/model.safetensors'"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "meminfo"
    empty.write_text("")  # rank 1's /proc/meminfo reads empty
    proc = launch(2, [VIEW, "--bind", empty, "/proc/meminfo", "--", sys.executable, "-m", "mlxdist.doctor"],
                  module=None, timeout=120)
    assert proc.returncode != 0
    assert _lines(proc.stderr, "problem") == [f"{PROBLEM}rank 1 could not be examined: KeyError: 'MemTotal'"], \
        proc.stderr[-3000:]
