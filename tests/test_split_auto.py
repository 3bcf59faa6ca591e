"""--expert-split auto (the default) under real mpirun: at load the ranks
weigh whole experts against experts cut in width (decide/splitcost.py,
from what decide/split_probe.py measures on them) where nothing needs whole
experts, --verbose prints both cuts' estimated steps, and the cut taken is
the one loaded, on every rank alike; where something needs whole experts or
the experts cannot be cut, it keeps them whole and says why."""

import json
import re

import pytest

from mlxdist.config import LoadOptions
from mlxdist.decide.splitcost import BATCHES

from conftest import launch

CUT = re.compile(r"^auto: experts (whole|cut in width)\b(.*)$", re.M)


def run(checkpoint, ranks: int, *extra, env=None):
    """One prompt under auto: the lines saying how the experts were cut, and the --json record."""
    args = ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", 4, "--quiet", "--verbose", "--json", *extra]
    proc = launch(ranks, args, env={"MLXDIST_AUTO_LINK": "measure", **(env or {})}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return CUT.findall(proc.stderr), json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_weighs_both_cuts_and_loads_the_one_it_took(checkpoint):
    cuts, record = run(checkpoint, 2, "--replicate", "never")
    assert len(cuts) == 1, cuts
    taken, why = cuts[0]
    assert record["expert_split"] == {"whole": "whole", "cut in width": "width"}[taken]
    assert "worst batch" in why
    steps = why.split("per step: ", 1)[1]
    for cut in ("whole", "width"):  # every batch estimated for both cuts, with the strategy each runs
        estimates = steps.split(f"{cut}: ", 1)[1].split(";")[0]
        assert [int(b) for b in re.findall(r"b = (\d+) [\d.]+ ms \([\w-]+\)", estimates)] == list(BATCHES), why
    assert len(record["tokens"]) == 4 and record["num_ranks"] == 2


@pytest.mark.parametrize("ranks, extra, env, reason", [
    (2, ["--replicate", "always"], {}, "every rank holds every expert"),
    (2, ["--replicate", "never"], {"MLXDIST_AUTO_LINK": "local"}, "MLXDIST_AUTO_LINK=local"),
    (3, ["--replicate", "never"], {}, "do not divide by 3"),  # its experts' 64 hidden units
], ids=["everywhere", "local-link", "cannot-cut"])
def test_whole_experts_where_width_cannot_or_need_not_run(checkpoint, ranks, extra, env, reason):
    cuts, record = run(checkpoint, ranks, *extra, env=env)
    assert len(cuts) == 1 and cuts[0][0] == "whole" and reason in cuts[0][1], cuts
    assert record["expert_split"] == "whole"


@pytest.mark.parametrize("options, weighs", [
    (dict(), True),
    (dict(mode="collective"), False),  # the exact modes keep whole experts
    (dict(mode="p2p"), False),
    (dict(placement={"version": 2}), False),
    (dict(rank0_experts=False), False),
    (dict(expert_capacity=2, layout="compact"), False),
    (dict(record_routing=True), False),
    (dict(replicate="always"), False),
    (dict(expert_split="whole"), False),
    (dict(expert_split="width"), False),
])
def test_what_lets_auto_cut_in_width(options, weighs):
    assert LoadOptions(model="m", **options).may_cut_in_width is weighs


@pytest.mark.parametrize("rank", [1, 0])
def test_a_probe_failing_on_one_rank_fails_the_load_on_every_rank_in_one_line(checkpoint, rank):
    """The rank whose probe fails still joins the link's all_sums and the
    exchange of figures: every rank ends the load with the same line, in
    seconds, none left waiting on another."""
    args = ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", 4, "--quiet", "--replicate", "never"]
    proc = launch(2, args, env={"MLXDIST_AUTO_LINK": "measure", "MLXDIST_FAULT": f"fail:at=split,rank={rank}"},
                  timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mlxdist: error:")]
    assert lines == ["mlxdist: error: --expert-split auto could not time the experts: "
                     f"RuntimeError: injected fault at split (--expert-split whole or width skips it) (rank {rank})"], \
        proc.stderr[-3000:]
