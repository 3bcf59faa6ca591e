"""Failures never split the ranks (docs/failures.md): under real mpirun, a
failure injected on one rank (``MLXDIST_FAULT``) at each shared step sends
every rank down the same path: that step fails on every rank and the job
goes on (the old placement kept, tokens equal to mlx-lm's), or the job ends
within seconds with one line naming the rank; no rank is left waiting."""

import json
import re
import time

import pytest

from conftest import ROOT, error_lines, last_json, launch
from test_api import mlx_lm_alone
from test_serve import Server, alone

PROMPT, MAX_TOKENS = "Experts are routed by a gate", 8  # as tests/scripts/agree.py
AGREE_FAULTS = "fail:at=place,rank={v},skip=1;fail:at=command,rank={v},op=probe;fail:at=balance,rank=0"
# Where one rank alone fails, no other rank ever says it failed too: the failed rank's wait for
# them (MLXDIST_AGREE_SECONDS, 5 s by default) is all slack, so these tests shorten it.
ALONE = {"MLXDIST_AGREE_SECONDS": "1"}


@pytest.mark.parametrize("dispatch,victim", [("collective", 1), ("p2p", 0)])
def test_every_rank_agrees_at_each_step(checkpoint, dispatch, victim):
    """One launch through every step that is not a forward pass on one rank:
    a placement failing half-way (its second layer) on ``victim``, a probe
    command failing there, rank 0's planning of the server's rebalancing;
    plus, in collective, a forward failing on every rank at once, and a
    second command while a stream is open."""
    path = checkpoint("qwen3_moe")
    faults = AGREE_FAULTS.format(v=victim)
    if dispatch == "collective":  # p2p workers run no forward of their own to fail in
        faults = "raise:rank=all,layer=1,step=2;" + faults
    proc = launch(2, [ROOT / "tests/scripts/agree.py", path, dispatch], module=None, timeout=120,
                  env={"MLXDIST_FAULT": faults})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    expected = mlx_lm_alone(path, PROMPT, MAX_TOKENS)
    if dispatch == "collective":
        assert got["failed_together"] == "generation failed: RuntimeError: injected fault at layer 1 of step 2"
    assert all(r.startswith("a stream is open: read it to its end or close() it before ")
               for r in got["during_stream"]), got["during_stream"]
    assert got["stream"] == got["tokens"] == expected
    assert "cannot prepare the new placement: RuntimeError: injected fault at place (layer" in got["place_failed"]
    assert got["place_failed"].endswith(f"(rank {victim})"), got["place_failed"]
    assert got["kept"] and got["tokens_after_failed_place"] == expected
    assert got["probe_failed"] == f"probe failed: RuntimeError: injected fault at command (probe) (rank {victim})"
    assert got["probe_after"] == [0, 1]
    assert got["rebalance"] == [{"placed": False, "failures": ["rank 0: RuntimeError: injected fault at balance"]}] * 2
    assert got["kept_after_rebalance"]
    assert got["placed"] and got["tokens_after_place"] == expected


@pytest.mark.parametrize("dispatch,fault,capacity", [
    ("collective", "raise:rank=0,layer=1,step=2", None),
    ("p2p", "raise:rank=0,layer=1,step=2", None),
    ("collective", "fail:at=page,rank=1", 2),
], ids=["rank0", "p2p-rank0", "paging-rank1"])
def test_a_forward_failing_on_one_rank_ends_the_job(checkpoint, dispatch, fault, capacity):
    """A forward pass (or a paging read inside one) fails on one rank (rank
    1 alone in a forward: test_reliability's unexpected error); the
    script catches the error and generates again: the other rank is inside
    the step's collectives (or, in p2p, released), so the job ends within
    seconds of the failure, the failed rank named with its cause."""
    script = [ROOT / "tests/scripts/fail_alone.py", checkpoint("qwen3_moe"), dispatch, *([capacity] if capacity else [])]
    proc = launch(2, script, module=None, timeout=90, env={"MLXDIST_FAULT": fault, **ALONE})
    ended = time.time()
    assert proc.returncode != 0 and "went on" not in proc.stdout, proc.stdout
    loaded = float(proc.stdout.split("loaded at ")[1].split()[0])
    assert ended - loaded < 30
    victim = fault.split("rank=")[1].split(",")[0]
    cause = "injected fault at page" if "page" in fault else "injected fault at layer 1 of step 2"
    line = f"mlxdist: error: rank {victim}: RuntimeError: {cause}"
    assert any(l.startswith(line) for l in error_lines(proc.stderr)), proc.stderr[-3000:]


def test_a_paging_read_failing_on_every_rank_fails_that_generation(checkpoint):
    """The same paging read failing on every rank: that generation raises
    GenerationFailed and the next one runs (with the slots as they were)."""
    proc = launch(2, [ROOT / "tests/scripts/fail_alone.py", checkpoint("qwen3_moe"), "collective", 2], module=None,
                  timeout=90, env={"MLXDIST_FAULT": "fail:at=page,rank=all"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "caught: generation failed: RuntimeError: injected fault at page" in proc.stdout
    assert "went on" in proc.stdout


@pytest.mark.parametrize("victim,seed", [(1, None), (0, 3)], ids=["rank1-batched", "rank0-single"])
def test_a_server_step_failing_on_one_rank_ends_the_job(checkpoint, victim, seed):
    """A batch step (unseeded requests) or a request served alone (seeded)
    failing on one rank: the server stops within seconds naming the rank,
    not after the watchdog's 10 x --timeout."""
    s = Server(checkpoint("qwen3_moe"), env={"MLXDIST_FAULT": f"raise:rank={victim},layer=1,step=3", **ALONE})
    try:
        tic = time.time()
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, **({"seed": seed} if seed is not None else {})}
        try:
            status, _ = s.request("POST", "/v1/completions", body, timeout=30)
            assert status != 200
        except OSError:
            pass  # the server's process ended under the request
        s.proc.wait(30)
        assert time.time() - tic < 30
    finally:
        s.stop()
    stderr = s.proc.stderr.read()
    assert s.proc.returncode != 0
    line = f"mlxdist: error: rank {victim}: RuntimeError: injected fault at layer 1 of step 3"
    assert any(l.startswith(line) for l in error_lines(stderr)), stderr[-3000:]


def test_a_server_step_failing_on_every_rank_fails_its_request(checkpoint):
    """The same failure on every rank at once: that request gets a 500, the
    next one mlx-lm's answer, and the server ends cleanly."""
    path = checkpoint("qwen3_moe")
    s = Server(path, env={"MLXDIST_FAULT": "raise:rank=all,layer=1,step=3"})
    try:
        status, body = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
        assert status == 500 and "injected fault at layer 1 of step 3" in body["error"]["message"], body
        status, body = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
        assert status == 200 and body["choices"][0]["text"] == alone(path, PROMPT, MAX_TOKENS), body
    finally:
        code = s.stop()
    assert code == 0, s.proc.stderr.read()[-3000:]


# (step, rank, skip), one load each, in turn. A skip counts the rank's earlier moments at that step: rank 0
# reads in load 1 too, rank 1 reaches its experts in load 3 (rank 0 failed just before), rank 0 times
# the dense layers in load 5 (rank 1's failure there is heard at that exchange).
LOAD_FAULTS = [("read", 1, 0), ("read", 0, 1), ("experts", 0, 0), ("experts", 1, 1), ("measure", 1, 0),
               ("measure", 0, 1)]


def load_faults_ran(proc, path):
    """What load_fails.py printed: every load failed on every rank with the
    fault's line, in seconds, and the last one generates mlx-lm's tokens."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    lines = [re.sub(r" \(traceback: [^)]+\)", "", f["line"]) for f in got["failed"]]  # where each rank kept it
    prefix = {"measure": "auto could not time the dense layers: "}
    assert lines == [f"{prefix.get(op, '')}RuntimeError: injected fault at load ({op}) (rank {rank})"
                     for op, rank, _ in LOAD_FAULTS], lines
    assert all(f["seconds"] < 20 for f in got["failed"]), got["failed"]
    assert got["tokens"] == mlx_lm_alone(path, PROMPT, MAX_TOKENS)


def load_fails_args(path):
    faults = ";".join(f"fail:at=load,op={op},rank={rank},skip={skip}" for op, rank, skip in LOAD_FAULTS)
    return [ROOT / "tests/scripts/load_fails.py", path, len(LOAD_FAULTS) + 1], {"MLXDIST_FAULT": faults,
                                                                             "MLXDIST_AUTO_LINK": "measure"}


def test_a_load_failing_on_one_rank_fails_on_every_rank_and_the_next_one_loads(checkpoint):
    """One launch, loads under auto with the link measured, each failing on
    one rank, rank 0 and rank 1 in turn, at a different step: before the
    checkpoint is read (the others are in the placement's exchange), before
    the experts are read (the others are in auto's exchanges), and while
    auto times the dense layers (the others are in that exchange). Each
    load fails on every rank, in seconds, with the same line naming the
    rank; the next loads and generates mlx-lm's tokens."""
    path = checkpoint("qwen3_moe")
    args, env = load_fails_args(path)
    load_faults_ran(launch(2, args, module=None, timeout=180, env=env), path)


def test_a_replica_failing_alone_fails_its_batch_and_the_job_goes_on(checkpoint):
    """A batch run as replicas (every rank decodes its own share, no
    collective inside): rank 1's share fails in the first batch, rank 0's in
    the second (its fault skips one generation). Each rank says so at the
    gather that ends the batch, so the batch fails on every rank with one
    line naming the rank, and the next batches run, alike."""
    path = checkpoint("qwen3_moe")
    faults = "raise:rank=1,layer=0,step=2;raise:rank=0,layer=0,step=2,skip=1"
    proc = launch(2, [ROOT / "tests/scripts/replica_fails.py", path, 4], module=None, timeout=120,
                  env={"MLXDIST_FAULT": faults, **ALONE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed_1, failed_0, *done = last_json(proc.stdout)["batches"]
    assert failed_1 == {"failed": "generation failed: RuntimeError: injected fault at layer 0 of step 2 (rank 1)"}
    assert failed_0 == {"failed": "generation failed: RuntimeError: injected fault at layer 0 of step 2 (rank 0)"}
    assert [d["strategy"] for d in done] == ["replicas"] * 2 and done[0] == done[1], done
    assert [len(t) for t in done[0]["tokens"]] == [6] * 4, done


def test_a_sequence_rank_0_runs_alone_fails_alone(checkpoint):
    """Over a dear emulated link (5 ms a call) with the model on every rank, auto runs one
    prompt on rank 0 alone; a fault in its forward fails that generation
    (the other ranks wait at its end, in none of its steps) and the next
    one gives mlx-lm's tokens: the job does not end."""
    from mlxdist.bench.linkemu import EmulatedLink, link_env

    path = checkpoint("qwen3_moe")
    dear = EmulatedLink("dear", 5000, 1000)  # 5 ms a call: splitting costs far more than the work it splits
    proc = launch(2, [ROOT / "tests/scripts/alone_fails.py", path], module=None, timeout=120,
                  env={**link_env(dear), "MLXDIST_AUTO_LINK": "measure",
                       "MLXDIST_FAULT": "raise:rank=0,layer=0,step=2", **ALONE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    assert got["strategy"] == "replicas", got
    assert got["failed"] == "generation failed: RuntimeError: injected fault at layer 0 of step 2", got
    assert got["tokens"] == mlx_lm_alone(path, PROMPT, MAX_TOKENS)


def test_a_job_file_through_failures_on_every_rank(checkpoint, tmp_path):
    """Every generation fails on every rank at once (the fault fires at every
    layer of each generation's second step): each job becomes an error
    record, batches split into single jobs first, and the run ends with 0."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text("".join(f'{{"id": "job-{i}", "prompt": "Prompt number {i} about experts"}}\n' for i in range(3)))
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "--jobs", jobs, "--out", out, "-m", 6, "--batch-size", 2],
                  timeout=90, env={"MLXDIST_FAULT": "raise:rank=all,layer=-1,step=2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sorted((json.loads(l) for l in out.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["id"] for r in records] == ["job-0", "job-1", "job-2"]
    assert all(r["error"] == f"line {i + 1}: generation failed: RuntimeError: injected fault at layer 0 of step 2"
               for i, r in enumerate(records)), records


def test_fault_specs_several_and_every_rank(monkeypatch):
    """MLXDIST_FAULT holds several faults; rank=all arms every rank; a fail
    fault fires once, after its skips; several faults at expert steps on
    one rank each fire at their own moment."""
    from mlxdist.runtime import faults

    monkeypatch.setenv("MLXDIST_FAULT", "raise:rank=all,layer=1,step=2;fail:at=place,rank=1,skip=1")
    assert faults.arm(0).action == "raise" and faults.arm(1).action == "raise"
    faults.point("place", 0, layer=0)  # not rank 0's
    faults.point("place", 1, layer=0)  # skipped
    with pytest.raises(RuntimeError, match=r"injected fault at place \(layer 2\)"):
        faults.point("place", 1, layer=2)
    faults.point("place", 1, layer=3)  # once only
    monkeypatch.setenv("MLXDIST_FAULT", "sleep:rank=1,layer=0,step=1,seconds=0;raise:rank=1,layer=-1,step=5")
    assert faults.arm(1).action == "sleep"
    faults.at_layer(0, 1)  # the first fault's moment
    with pytest.raises(RuntimeError, match="injected fault at layer 1 of step 5"):
        faults.at_layer(1, 5)  # the second's: each fault of a rank fires
    monkeypatch.delenv("MLXDIST_FAULT")
    assert faults.arm(1) is None
