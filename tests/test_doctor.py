"""``python -m mlxdist.doctor`` on hosts made of network namespaces
(tests/netns.py): every rank's facts and the link matrix, exit 0 when ready; a version mismatch and a loopback address across hosts, made
on purpose, each named in a line of its own with a non-zero exit."""

from conftest import last_json


def test_ready_cluster_reports_every_rank_and_every_link(hosts, checkpoint):
    path = checkpoint("qwen3_moe")
    proc = hosts.mpirun([0, 1, 2], ["--model", path, "--backend", "ring", "--json"], module="mlxdist.doctor")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlxdist doctor: ready" in proc.stderr
    got = last_json(proc.stdout)
    assert got["problems"] == []
    assert [r["host"] for r in got["ranks"]] == hosts.names[:3]
    assert len({r["model"]["fingerprint"] for r in got["ranks"]}) == 1
    assert all(r["backend"] == "ring" and r["threads"] == "multiple" for r in got["ranks"])
    for i, row in enumerate(got["addresses"]):  # each rank's address toward the others: its own on the bridge
        assert row["toward"] == [None if j == i else hosts.addresses[i] for j in range(3)]
    assert got["reach"] == [[None if i == j else True for j in range(3)] for i in range(3)]
    assert {(i, j) for i, j, *_ in got["timing"]["pairs"]} == {(0, 1), (1, 2), (0, 2)}  # ring neighbours, 3 ranks
    assert all(lat > 0 and bw > 0 for *_, lat, bw in got["timing"]["pairs"])


def test_a_version_mismatch_and_a_loopback_address_are_named(hosts):
    env = {"MLXDIST_DOCTOR_PRETEND": "rank=1,mlx=0.0.1", "MLXDIST_RING_INTERFACE": "lo"}
    proc = hosts.mpirun([0, 1], ["--backend", "mpi"], module="mlxdist.doctor", env=env)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mlxdist doctor: problem: ")]
    assert lines[0].startswith("mlxdist doctor: problem: mlx versions differ: rank 0 0.32"), proc.stderr[-3000:]
    assert lines[0].endswith(", rank 1 0.0.1")
    assert sum("the loopback address 127.0.0.1" in l for l in lines) == 2, lines  # 0 -> 1 and 1 -> 0
    assert len(lines) == 3, lines


def test_a_model_on_no_rank_is_named_and_the_fit_lines_are_the_callers():
    """The fit is doctor/fit.py's (model/fit.py's, as a load reckons it:
    tests/test_memory_fit.py); problems() adds its lines after its own."""
    from mlxdist.doctor.report import problems

    def rank(r, available, model):
        return {"rank": r, "versions": {}, "mpi": "x", "threads": "multiple", "available_gb": available,
                "cache": "/c", "cache_free_gb": 50.0, "model": model}

    model = {"present": True, "weights_gb": 100.0, "fingerprint": "ab", "where": "/m"}
    ranks = [rank(0, 80.0, model), rank(1, 30.0, model), rank(2, 80.0, {"present": False, "where": "/m: no"})]
    addresses = [{"host": {"name": f"h{i}", "addresses": []}, "toward": [None] * 3, "errors": {}} for i in range(3)]
    assert problems(ranks, addresses, [[None] * 3] * 3) == []  # rank 2 is sent its share: one copy is enough
    assert problems(ranks, addresses, [[None] * 3] * 3, fit=["rank 1 needs"]) == ["rank 1 needs"]
    nowhere = [rank(r, 80.0, {"present": False, "where": "/m: no"}) for r in range(3)]
    assert problems(nowhere, addresses, [[None] * 3] * 3) == ["no rank has the model: /m: no"]
