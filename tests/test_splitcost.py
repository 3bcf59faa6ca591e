"""--expert-split auto's rule (decide/splitcost.py) and the load it weighs
(engine/split_probe.busiest_load) as plain functions: whole experts leave
the busiest rank over the mean share of a step's slots; width wins where its
narrow products cost what their bytes say and splits the dense part for one
sequence; where each narrow product costs more than its share (as the MLX
expert-parallel PR measured on two M3 Ultras from four tokens a step), whole
experts win; near ties keep whole."""

import pytest

from mlxdist.decide.linkcost import LOCAL, AutoInputs, DenseCost, LinkCost
from mlxdist.decide.splitcost import BATCHES, TIE, ExpertWork, choose_split
from mlxdist.decide.traffic import Shape
from mlxdist.decide.split_probe import busiest_load

QWEN3_30B = Shape(hidden=2048, top_k=8, layers=48, moe_layers=48, itemsize=2)
DENSE = DenseCost(fixed=4e-3, per_row=2e-5, split=0.8)
TEN_GBE = LinkCost(275e-6, 1 / 1.1e9)


def inputs(link=LOCAL, dense=DENSE):
    return AutoInputs(link, dense, QWEN3_30B)


def work(whole, width):
    """Per-layer expert seconds by batch, from two functions of b."""
    return ExpertWork({"whole": {b: whole(b) for b in BATCHES}, "width": {b: width(b) for b in BATCHES}})


def test_width_where_its_products_cost_their_share():
    """Each rank reads 1/N of every touched expert: never more than whole's busiest rank."""
    per_expert, ranks = 1e-4, 2
    owners = [e * ranks // 128 for e in range(128)]
    expert_work = work(lambda b: busiest_load(owners, 8, b, ranks, "whole")[1] * per_expert,
                       lambda b: busiest_load(owners, 8, b, ranks, "width")[1] * per_expert / ranks)
    choice = choose_split(inputs(), expert_work, ranks, "mpi", shardable=True)
    assert choice.split == "width", choice.describe()
    assert choice.strategies["width"][1] == "collective-tp" and choice.strategies["whole"][1] == "collective"
    assert all(choice.steps["width"][b] <= choice.steps["whole"][b] for b in BATCHES)


def test_whole_where_narrow_products_cost_more_from_a_few_tokens():
    """The per-layer times the MLX expert-parallel PR measured (2 x M3 Ultra,
    Mixtral's shapes): whole 1.78 / 1.64 / 2.03 ms, width (tensor parallel)
    1.54 / 2.54 / 2.72 ms at 1 / 4 / 32 tokens. Width wins one sequence by
    14 %, loses four tokens by 55 %: whole has the better worst batch."""
    measured_whole = {1: 1.78e-3, 4: 1.64e-3, 8: 1.8e-3, 32: 2.03e-3}
    measured_width = {1: 1.54e-3, 4: 2.54e-3, 8: 2.6e-3, 32: 2.72e-3}
    choice = choose_split(inputs(dense=DenseCost(0.0, 0.0)), ExpertWork({"whole": measured_whole, "width": measured_width}),
                          2, "mpi", shardable=False)
    assert choice.split == "whole", choice.describe()
    ratio, batch = choice.worst["width"]
    assert batch == 4 and ratio == pytest.approx(2.54 / 1.64, rel=1e-6)
    assert choice.worst["whole"] == (pytest.approx(1.78 / 1.54, rel=1e-6), 1)
    assert "worst batch" in choice.describe() and "b = 32" in choice.describe()


def test_near_ties_keep_whole_experts():
    same = lambda b: 1e-3 * b  # noqa: E731
    assert choose_split(inputs(), work(same, same), 2, "mpi", shardable=False).split == "whole"
    almost = lambda b: 1e-3 * b * (1 - TIE / 4)  # noqa: E731
    assert choose_split(inputs(dense=DenseCost(0.0, 0.0)), work(same, almost), 2, "mpi", shardable=False).split == "whole"


def test_a_dear_link_never_favours_whole_experts():
    """Width's candidates put no more on the wire than whole's: one row's
    all_sum [b, D] where collective sends [b, K, D]; dp the same rows."""
    equal = lambda b: 1e-3  # noqa: E731
    for link in (LOCAL, TEN_GBE, LinkCost(50e-3, 1 / 1e9)):
        choice = choose_split(inputs(link, DenseCost(0.0, 0.0)), work(equal, equal), 2, "mpi", shardable=True)
        assert all(choice.steps["width"][b] <= choice.steps["whole"][b] * (1 + 1e-9) for b in BATCHES), choice.describe()


@pytest.mark.parametrize("ranks, top_k, experts", [(2, 4, 64), (4, 8, 256), (3, 2, 8)])
def test_the_busiest_rank_with_whole_experts(ranks, top_k, experts):
    owners = [e * ranks // experts for e in range(experts)]
    slots, distinct = busiest_load(owners, top_k, 1, ranks, "whole")
    assert top_k / ranks < slots <= top_k and distinct == slots  # one row: K distinct experts
    assert busiest_load(owners, top_k, 1, ranks, "width") == (top_k, top_k)
    many_slots, many_distinct = busiest_load(owners, top_k, 32, ranks, "whole")
    assert many_slots >= 32 * top_k / ranks and many_distinct <= -(-experts // ranks)
    wide_slots, wide_distinct = busiest_load(owners, top_k, 32, ranks, "width")
    assert wide_slots == 32 * top_k and many_distinct < wide_distinct <= experts
    assert busiest_load(owners, top_k, 8, ranks, "whole") == busiest_load(owners, top_k, 8, ranks, "whole")  # a fixed draw
