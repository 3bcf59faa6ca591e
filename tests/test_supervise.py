"""The supervisor (python -m mlxdist.supervise) under real mpirun: it starts
a job again only for a lost rank, and on fewer ranks plans again what
depended on N: each survivor keeps its host's --rank-memory budget, and a
--placement is rebuilt for the survivors from the recorded routing."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, launch, mpirun_env
from mlxdist.cli.relaunch import RankSlot, lost_ranks, rank_slots
from mlxdist.errors import UserError

HOSTS = [{"ssh": "mac-a", "memory_gb": 0.004}, {"ssh": "mac-b", "memory_gb": 0.001},
         {"ssh": "mac-c", "memory_gb": 0.002}]


def supervise(args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mlxdist.supervise", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**mpirun_env(), **(env or {})}, cwd=ROOT)


def records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_an_unequal_cluster_that_loses_a_rank_goes_on_with_replanned_budgets(checkpoint, tmp_path):
    """3 ranks on this machine with budgets 4 : 1 : 2, given per rank (per
    host, one machine's ranks would share its budget evenly; matching by
    host name is test_budgets_follow_hosts_by_name's) and a placement for 3; rank 1 is killed mid-job. The supervisor starts 2
    ranks with ranks 0's and 2's budgets (0.004, 0.002) and a placement for
    2 rebuilt from the recorded routing (used to be refused: 3 budgets for
    2 ranks); every job once, tokens equal to an undisturbed run's."""
    from mlxdist.model.balance import balanced
    from mlxdist.model.routing_file import RoutingStats

    model, jobs = checkpoint("qwen3_moe"), tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"j{i}", "prompt": f"job number {i} " * (i % 3 + 1)}) + "\n"
                            for i in range(6)))
    routing, placement3 = tmp_path / "routing.json", tmp_path / "placement3.json"
    common = ["--model", model, "--jobs", jobs, "-m", 8, "--batch-size", 1, "--rank-memory", "0.004,0.001,0.002"]
    clean = launch(3, [*common, "--out", tmp_path / "clean.jsonl", "--record-routing", routing,
                       "--save-placement", placement3])
    assert clean.returncode == 0, clean.stderr[-3000:]
    out, used = tmp_path / "out.jsonl", tmp_path / "used.json"
    proc = supervise(["--ranks", 3, "--routing", routing, "--", *common, "--out", out, "--placement", placement3,
                      "--save-placement", used], env={"MLXDIST_FAULT": "kill:rank=1,layer=1,step=5,skip=5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("mlxdist.supervise: starting") == 2, proc.stderr[-3000:]
    assert (f"restart on 2 ranks after losing rank(s) [1] (budgets localhost 0.004, localhost 0.002 GB; "
            f"placement from {routing}): first result") in proc.stderr
    expected = balanced(RoutingStats.load(routing).layers, 2, 0, [0.004, 0.002])
    assert json.loads(used.read_text()) == expected.to_json()
    got, want = records(out), records(tmp_path / "clean.jsonl")
    assert sorted(got) == sorted(want) and all(got[i]["tokens"] == want[i]["tokens"] for i in want)


def test_a_run_that_fails_to_load_is_not_restarted(checkpoint, tmp_path):
    """A model that fails to load on every rank fails again on fewer: one
    start, one line saying why, the run's status (it used to be restarted
    on 2 ranks, then 1)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint("qwen3_moe").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    proc = supervise(["--ranks", 3, "--", "--model", broken, "--jobs", jobs, "--out", tmp_path / "out.jsonl"],
                     timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("mlxdist.supervise: starting") == 1, proc.stderr[-3000:]
    assert "cannot load" in proc.stderr
    assert "mlxdist.supervise: error: the run failed (exit status 1) and no rank was lost" in proc.stderr


def test_what_counts_as_a_lost_rank():
    """A rank killed by a signal or on a host the launcher lost is lost; a run
    whose first rank to end exited with an error status lost none, even where
    a rank that went on saw that rank's process gone."""
    slots = [RankSlot("a"), RankSlot("a"), RankSlot("b"), RankSlot("b")]
    killed = ("prterun noticed that process rank 2 with PID 15574 on node b exited on\nsignal 9 (Killed).\n"
              "mlxdist: error: rank 0: the job was stopped while ...; rank 2 stopped (process gone)")
    assert lost_ranks(killed, slots) == [2]
    daemon = ("PRTE has lost communication with a remote daemon.\n  HNP daemon   : [prterun-x@0,0] on node a\n"
              "  Remote daemon: [prterun-x@0,1] on node b\n")
    assert lost_ranks(daemon, slots) == [2, 3]
    failed = ("mlxdist: error: cannot load M: ...\nrank 0: the job was stopped while loading; rank 1 stopped "
              "(process gone)\nprterun detected that one or more processes exited with non-zero status, thus "
              "causing\nthe job to be terminated.")
    assert lost_ranks(failed, slots) == []
    assert lost_ranks("mlxdist: error: rank 0: timed out ...; ranks 1, 3 stopped (process gone)", slots) == [1, 3]
    # a rank stopped or cut off: the heartbeat's line, though rank 0 then ends with an error status
    stopped = ("mlxdist: error: rank 1 (host a) sent no heartbeat for 5.0 s: lost\nprterun detected that one or "
               "more processes exited with non-zero status, thus causing\nthe job to be terminated.")
    assert lost_ranks(stopped, slots) == [1]


def test_budgets_follow_hosts_by_name(tmp_path):
    """Budgets are matched as the run matches them (budgets.budgets_for_ranks): a JSON hostfile's memory_gb
    goes to the ranks of the host of that name in the Open MPI hostfile, whatever the order of either file,
    split evenly over the host's ranks; without a hostfile every rank is on this machine, matched by its name,
    and a host the budgets do not name is refused."""
    import socket

    hostfile, hosts = tmp_path / "hostfile", tmp_path / "hosts.json"
    hostfile.write_text("MAC-C.local slots=2\nmac-a slots=1\n")
    hosts.write_text(json.dumps(HOSTS))
    assert rank_slots(3, str(hostfile), str(hosts)) == [RankSlot("MAC-C.local", 0.001),
                                                        RankSlot("MAC-C.local", 0.001), RankSlot("mac-a", 0.004)]
    assert rank_slots(2, None, "3,1") == [RankSlot("localhost", 3.0), RankSlot("localhost", 1.0)]
    assert rank_slots(2, None, f"{socket.gethostname()}=3") == [RankSlot("localhost", 1.5)] * 2
    with pytest.raises(UserError, match=f"rank 0 runs on host {socket.gethostname()}, which --rank-memory does "
                                        f"not name"):
        rank_slots(3, None, str(hosts))


def test_fewer_ranks_are_planned_again(tmp_path):
    """On the survivors: mpirun's --host keeps each host's remaining slots in
    order; --rank-memory lists the survivors' budgets (either form of the
    option); a --placement without recorded routing gives way to the even
    policy, with one from the routing where it exists."""
    from mlxdist.cli.relaunch import host_list, replanned_args

    survivors = [RankSlot("mac-a", 0.004), RankSlot("mac-c", 0.002), RankSlot("mac-c", 0.002)]
    assert host_list(survivors) == "mac-a:1,mac-c:2"
    args = ["--model", "M", "--rank-memory=hosts.json", "--placement", "p3.json", "-m", "8"]
    replanned, said = replanned_args(args, survivors, str(tmp_path / "none.json"), str(tmp_path / "out.jsonl"))
    assert replanned == ["--model", "M", "-m", "8", "--rank-memory", "0.004,0.002,0.002"]
    assert said == " (budgets mac-a 0.004, mac-c 0.002, mac-c 0.002 GB; placement even)"
    from mlxdist.model.routing_file import RoutingStats

    routing = tmp_path / "routing.json"
    RoutingStats({0: [5, 1, 1, 1], 1: [1, 1, 1, 5]}, 2, "qwen3_moe", None).save(routing)
    replanned, said = replanned_args(args, survivors, str(routing), str(tmp_path / "out.jsonl"))
    placement = tmp_path / "out.jsonl.placement-3.json"
    assert replanned[-2:] == ["--placement", str(placement)] and "placement from" in said
    assert json.loads(placement.read_text())["num_ranks"] == 3
