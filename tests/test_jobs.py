"""Job files under real mpirun: one record per job, malformed lines become
error records, and a job killed with SIGKILL at any point resumes to the same
complete output with no id twice. A job file always finishes: every kind of
bad line is an error record of its own, duplicate ids are refused before
anything runs, --out has one writer at a time, and damaged --out lines are
reported and their jobs redone."""

import fcntl
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, ROOT, error_lines, kill_session, launch, mlx_lm_loaded, mpirun_env


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
    ]  # a duplicate id refuses the whole file now: test_duplicate_ids_are_refused
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


def job_ids(tokenizer, prompt, system=None, raw=False):
    """A job's prompt line as the run encodes it: through the chat template
    (after ``system``), or raw (--ignore-chat-template)."""
    if raw:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": system}] if system is not None else []
    return list(tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}],
                                              add_generation_prompt=True))


def mlx_lm_greedy(path, prompts, max_tokens, **encoding):
    """mlx-lm's greedy tokens for each prompt line (encoded as ``job_ids``),
    the model loaded once: greedy and exact, what a run writes for them."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm_loaded(str(path))
    return [[s.token for s in stream_generate(model, tokenizer, mx.array(job_ids(tokenizer, p, **encoding)),
                                              max_tokens=max_tokens)] for p in prompts]


@pytest.fixture(scope="module")
def uninterrupted(checkpoint, tmp_path_factory):
    """The job file, and what an uninterrupted run of it writes, by id:
    mlx-lm's tokens for each job."""
    jobs = tmp_path_factory.mktemp("jobs") / "jobs.jsonl"
    write_jobs(jobs, 16)
    lines = [json.loads(l) for l in jobs.read_text().splitlines()]
    tokens = mlx_lm_greedy(checkpoint("qwen3_moe"), [l["prompt"] for l in lines], 24)
    return jobs, {l["id"]: t for l, t in zip(lines, tokens)}


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


def warned(stderr, path, lineno):
    """Whether stderr holds the one-line warning about ``path``'s line ``lineno``."""
    return re.search(rf"mlxdist: warning: [^\n]*{re.escape(path.name)} line {lineno}\b", stderr) is not None


def supervise(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlxdist.supervise", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=mpirun_env(), cwd=ROOT)


def test_every_kind_of_bad_line_is_an_error_record(checkpoint, tmp_path):
    """Each of these used to end the run on every rank, identically on every
    rerun (the huge integer crashed the supervisor too): now each is an
    error record for its id naming its line, with one warning, and the good
    lines run. The supervisor reads the same file without crashing and
    starts once, with no rank blamed."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    good = lambda i: json.dumps({"id": f"good-{i}", "prompt": f"Prompt number {i} about experts"}).encode()
    lines = [  # (line, id of its record or None for a result, what its reason must name)
        (good(0), None, None),
        (json.dumps({"id": "seed-str", "prompt": "x", "seed": "abc"}).encode(), "seed-str", "seed"),
        (b'{"id": "seed-huge", "prompt": "x", "seed": ' + b"1" * 4300 + b"}", "seed-huge", "seed"),
        (b'{"id": "utf8", "prompt": "\xff\xfe"}', "line:4", "UTF-8"),
        (b'{"id": "deep", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "line:5", "nests"),
        (json.dumps({"id": "no-role", "messages": [{"content": "hi"}]}).encode(), "no-role", "role"),
        (json.dumps({"id": "seed-64", "prompt": "x", "seed": 2**64}).encode(), "seed-64", "seed"),
        (json.dumps({"id": "top-k-float", "prompt": "x", "top_k": 1e6}).encode(), "top-k-float", "top_k"),
        (json.dumps({"id": "top-k-vocab", "prompt": "x", "top_k": 10**6, "temp": 0.5}).encode(), "top-k-vocab",
         "vocabulary"),
        (json.dumps({"id": None, "prompt": "x"}).encode(), "line:10", "null id"),
        (json.dumps({"id": 7, "prompt": "an integer id"}).encode(), None, None),
        (json.dumps({"id": "long", "prompt": "a" * (2 << 20)}).encode(), "line:12", "longer than"),
        (b'{"id": "nan", "prompt": "x", "temp": NaN}', "nan", "temp"),
        (b'{"id": "huge-max", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "huge-max", "max_tokens"),
        (json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}).encode(), None, None),
        (json.dumps({"id": "not-a-string", "prompt": ["x"]}).encode(), "not-a-string", "prompt"),
        (good(2), None, None),
    ]
    jobs.write_bytes(b"\n".join(line for line, _, _ in lines) + b"\n")
    args = ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 4, "--batch-size", 2]
    proc = launch(2, args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_records(out)
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records) == len(lines)
    for lineno, (_, bad_id, word) in enumerate(lines, 1):
        if bad_id is None:
            continue
        record = by_id[bad_id]
        assert set(record) == {"id", "error", "line"} and record["line"] == lineno, record
        assert f"line {lineno}" in record["error"] and word in record["error"], record
        assert "\n" not in record["error"] and len(record["error"]) < 300, record
        assert warned(proc.stderr, jobs, lineno), (lineno, proc.stderr[-3000:])
    for good_id in ("good-0", "7", "chat", "good-2"):
        assert "error" not in by_id[good_id] and 1 <= len(by_id[good_id]["tokens"]) <= 4, by_id[good_id]

    again = supervise(["--ranks", 2, "--", *args])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("mlxdist.supervise: starting") == 1, again.stderr[-3000:]
    assert read_records(out) == records  # everything was done: nothing written twice


def test_duplicate_ids_are_refused(tmp_path):
    """The same id twice refuses the whole file at the start, naming the
    lines, before the model loads (the model here does not exist) and
    before --out is touched; the supervisor refuses it without starting."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    ids = ["a", "b", "a", "c", "b", "a"]
    jobs.write_text("".join(json.dumps({"id": i, "prompt": "x"}) + "\n" for i in ids))
    args = ["--model", tmp_path / "no-such-model", "--jobs", jobs, "--out", out]
    proc = launch(2, args)
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "duplicate ids" in line and "'a' on lines 1, 3, 6" in line and "'b' on lines 2, 5" in line, line
    assert not out.exists()
    refused = supervise(["--ranks", 2, "--", *args], timeout=60)
    assert refused.returncode == 2 and "starting" not in refused.stderr, refused.stderr
    assert "mlxdist.supervise: error:" in refused.stderr and "'a' on lines 1, 3, 6" in refused.stderr


def test_integer_and_string_ids_are_one_id(tmp_path):
    """Ids are strings: an integer id is its str(), so 1 and "1" are the same
    id, a duplicate (they used to collide and one was silently dropped)."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n" + json.dumps({"id": "1", "prompt": "y"}) + "\n")
    proc = launch(2, ["--model", tmp_path / "no-such-model", "--jobs", jobs, "--out", out])
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "duplicate ids" in line and "'1' on lines 1, 2" in line, line


def test_a_second_writer_is_refused(tmp_path):
    """--out has one writer: with its flock held (here by the test process),
    a run stops with one line naming the holder, before loading the model
    (which does not exist here), and writes nothing."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    write_jobs(jobs, 2)
    with open(out, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = launch(2, ["--model", tmp_path / "no-such-model", "--jobs", jobs, "--out", out])
    assert proc.returncode != 0
    pid = os.getpid() if os.path.exists("/proc/locks") else "unknown"
    assert error_lines(proc.stderr) == [f"mlxdist: error: {out} is being written by another run (pid {pid})"], \
        proc.stderr[-2000:]
    assert out.read_text() == ""


def test_damaged_out_lines_are_reported_and_redone(checkpoint, tmp_path):
    """A damaged line in the middle of --out (not JSON, or no id) is
    reported with its line number and ignored; the job it held runs again.
    Error records count as finished, unless --retry-errors."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    write_jobs(jobs, 4, [json.dumps({"id": "hot", "prompt": "x", "temp": -1})])
    args = ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 4, "--batch-size", 2]
    proc = launch(2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = {r["id"]: r for r in read_records(out)}
    lines = out.read_text().splitlines()
    lines[[json.loads(l)["id"] for l in lines].index("job-1")] = 'this line is not JSON {"id": "job-1"'
    lines.insert(2, json.dumps({"tokens": [1, 2, 3]}))
    damaged = [n for n, l in enumerate(lines, 1) if l.startswith("this line") or l.startswith('{"tokens"')]
    out.write_text("\n".join(lines) + "\n")
    proc = launch(2, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for n in damaged:
        assert warned(proc.stderr, out, n), (n, proc.stderr[-3000:])
    valid = [json.loads(l) for l in out.read_text().splitlines() if l.startswith('{"id"')]
    assert sorted(r["id"] for r in valid) == sorted(first)  # job-1 redone; hot's error not redone
    assert next(r for r in valid if r["id"] == "job-1")["tokens"] == first["job-1"]["tokens"]

    proc = launch(2, [*args, "--retry-errors"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    hot = [r for r in read_records_lenient(out) if r.get("id") == "hot"]
    assert len(hot) == 2 and all(r["error"] == "temperature must be >= 0, got -1" for r in hot)
    assert sorted({r["id"] for r in read_records_lenient(out)}) == sorted(first)


def read_records_lenient(path):
    """The JSON lines of ``path``, skipping the ones that are not."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in out if isinstance(r, dict) and "id" in r]


@pytest.mark.parametrize("raw", [False, True])
def test_job_prompts_are_templated_like_p(checkpoint, tmp_path, raw):
    """A job file's prompt line is encoded as -p's prompt is: through the chat
    template with --system-prompt, or raw with --ignore-chat-template. The
    job's tokens equal mlx-lm's for that encoding (as -p's do: test_cli.py)."""
    from mlx_lm.utils import load_tokenizer

    path = checkpoint("qwen3_moe")
    prompt = "Prompt number 3 about experts"
    flags, encoding = (["--ignore-chat-template"], {"raw": True}) if raw else \
        (["--system-prompt", "Be brief."], {"system": "Be brief."})
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text(json.dumps({"id": "a", "prompt": prompt}) + "\n" + json.dumps({"id": "b", "prompt": "other"}) + "\n")
    by_job = launch(2, ["--model", path, "--jobs", jobs, "--out", out, "-m", 6, *flags])
    assert by_job.returncode == 0, by_job.stderr[-2000:]
    record = next(r for r in read_records(out) if r["id"] == "a")
    (expected,) = mlx_lm_greedy(path, [prompt], 6, **encoding)
    assert record["tokens"] == expected
    assert record["prompt_tokens"] == len(job_ids(load_tokenizer(path), prompt, **encoding))


def test_endless_and_shared_files_are_refused_at_start(tmp_path):
    """A job file or --out that never ends or never takes a write (a device:
    /dev/zero and /dev/urandom used to be read forever, /dev/full spun at
    --out's repair) or --out naming the job file itself (also through a
    symlink: the results were appended to the jobs): one line, every rank
    ends, before the model loads (it does not exist here), the job file
    untouched."""
    jobs = tmp_path / "jobs.jsonl"
    write_jobs(jobs, 2)
    before = jobs.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(jobs)
    cases = [
        ("/dev/zero", tmp_path / "out.jsonl", "job file /dev/zero is a character device, not a regular file"),
        ("/dev/urandom", tmp_path / "out.jsonl", "job file /dev/urandom is a character device, not a regular file"),
        (jobs, "/dev/full", "--out /dev/full is a character device, not a regular file"),
        (jobs, jobs, f"--out {jobs} is the job file {jobs}"),
        (jobs, link, f"--out {link} is the job file {jobs}"),
    ]
    for jobs_path, out, message in cases:
        proc = launch(2, ["--model", tmp_path / "no-such-model", "--jobs", jobs_path, "--out", out], timeout=60)
        lines = error_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert jobs.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


def test_a_full_disk_ends_the_run_with_one_line(checkpoint, tmp_path):
    """--out on a file system that fills up mid-run (rank 0's view: a 4 KiB
    tmpfs, tests/scripts/rank_view.py): the write error is one line and
    every rank exits 1."""
    jobs, full = tmp_path / "jobs.jsonl", tmp_path / "full"
    write_jobs(jobs, 60)
    view = [ROOT / "tests/scripts/rank_view.py", "--ranks", 0, "--hide", full, "--hide-size", "4k", "--"]
    proc = launch(2, [*view, sys.executable, "-m", "mlxdist.run", "--model", checkpoint("tiny"), "--jobs", jobs,
                      "--out", full / "out.jsonl", "-m", 8, "--batch-size", 4], module=None, timeout=120)
    lines = error_lines(proc.stderr.replace("\r", "\n"))
    assert proc.returncode == 1 and lines == [f"mlxdist: error: cannot write {full / 'out.jsonl'}: No space left on "
                                              f"device; the run stops (a rerun resumes after the records written)"], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
