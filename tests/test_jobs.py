"""Job files under real mpirun: one record per job, malformed lines become
error records, and a job killed with SIGKILL at any point resumes to the same
complete output with no id twice."""

import json
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, ROOT, kill_session, launch, mpirun_env


def write_jobs(path, n, extra=()):
    lines = [json.dumps({"id": f"job-{i}", "prompt": f"Prompt number {i} about experts"}) for i in range(n)]
    path.write_text("\n".join([*lines, *extra]) + "\n")


def read_records(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_job_file_records(checkpoint, tmp_path):
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    extra = [
        "this is not json",
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        json.dumps({"id": "hot", "prompt": "x", "temp": -1}),
        json.dumps({"id": "job-0", "prompt": "a duplicate id is skipped"}),
    ]
    write_jobs(jobs, 5, extra)
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 6, "--batch-size", 3])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["id"]: r for r in read_records(out)}
    assert len(records) == len(read_records(out)) == 9
    assert records["line:6"]["error"].startswith("line 6 is not JSON")
    assert records["line:7"]["error"] == "line 7 has no id"
    assert records["hot"]["error"] == "temperature must be >= 0, got -1"
    assert len(records["chat"]["tokens"]) <= 3
    assert all(len(records[f"job-{i}"]["tokens"]) == 6 for i in range(5))
    assert records["job-0"]["batch_size"] == 3
    assert "jobs" in proc.stderr  # the progress bar


def _run_until_killed(args, out, min_records):
    """Start the job, SIGKILL every process of it once ``out`` holds at least
    ``min_records`` lines. Rank 0 stalls at the start of the next job (a
    test fault), so the job cannot finish before the kill on a busy machine."""
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "mlxdist.run", *map(str, args)]
    env = {**mpirun_env(), "MLXDIST_FAULT": f"sleep:rank=0,layer=1,step=1,skip={min_records},seconds=600"}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= min_records:
            break
        time.sleep(0.05)
    kill_session(proc.pid)
    proc.wait()


@pytest.fixture(scope="module")
def uninterrupted(checkpoint, tmp_path_factory):
    """The job file and the output of an uninterrupted run, by id."""
    tmp = tmp_path_factory.mktemp("jobs")
    jobs, out = tmp / "jobs.jsonl", tmp / "clean.jsonl"
    write_jobs(jobs, 16)
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 24, "--batch-size", 1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return jobs, {r["id"]: r["tokens"] for r in read_records(out)}


@pytest.mark.parametrize("kill_after", [1, 4, 9])
def test_resume_after_kill(checkpoint, tmp_path, uninterrupted, kill_after):
    jobs, clean = uninterrupted
    out = tmp_path / "out.jsonl"
    args = ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 24, "--batch-size", 1]
    _run_until_killed(args, out, kill_after)
    assert len(read_records(out)) < 16, "the job finished before it could be killed"
    with open(out, "a") as f:  # what a crash mid-write leaves
        f.write('{"id": "job-15", "text": "half')
    proc = launch(2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "repaired" in proc.stderr
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(clean)
    assert all(r["tokens"] == clean[r["id"]] for r in records)


def test_supervisor_finishes_the_job_without_a_lost_rank(checkpoint, tmp_path, uninterrupted):
    """kill -9 of rank 2 mid-job at np = 3: the supervisor starts the job
    again on 2 ranks, the output resumes where it stopped, every id once,
    tokens equal to an undisturbed run's; the restart is timed."""
    import subprocess
    import sys

    from conftest import ROOT, mpirun_env

    jobs, clean = uninterrupted
    out = tmp_path / "out.jsonl"
    env = {**mpirun_env(), "MLXDIST_FAULT": "kill:rank=2,layer=1,step=5,skip=5"}
    proc = subprocess.run(
        [sys.executable, "-m", "mlxdist.supervise", "--ranks", "3", "--", "--model", str(checkpoint("qwen3_moe")),
         "--jobs", str(jobs), "--out", str(out), "-m", "24", "--batch-size", "1"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 2 stopped (process gone)" in proc.stderr
    assert "mlxdist.supervise: restart on 2 ranks after losing rank(s) [2]: first result" in proc.stderr
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(clean)
    assert all(r["tokens"] == clean[r["id"]] for r in records)
