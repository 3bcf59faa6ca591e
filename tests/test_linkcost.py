"""auto's cost model (decide/linkcost.py, rule.auto_choice) as plain
functions: on a link as fast as one host's it is the rule measured there
(rule.auto_mode); a dearer link moves it to the strategy that puts
less on the wire per step, by the measured latency and bandwidth."""

import pytest

from mlxdist.decide import rule as auto_rule
from mlxdist.decide.linkcost import LOCAL, AutoInputs, DenseCost, LinkCost, estimate
from mlxdist.decide.traffic import Shape

TINY = Shape(hidden=64, top_k=4, layers=3, moe_layers=3, itemsize=4)  # the tests' qwen3_moe
QWEN3_30B = Shape(hidden=2048, top_k=8, layers=48, moe_layers=48, itemsize=2)
DENSE = [DenseCost(0.0, 0.0), DenseCost(1e-4, 1e-4, 0.5), DenseCost(5e-3, 1e-6, 0.9), DenseCost(2e-3, 3e-4, 0.3)]
FAST = [LinkCost(0.0, 0.0), LinkCost(13e-6, 1 / 20e9), LOCAL]  # up to one host's
TEN_GBE = LinkCost(275e-6, 1 / 1.1e9)  # the benchmark's 10gbe preset: 100 us + Metal's hand-off, 1.1 GB/s
SLOW = LinkCost(50e-3, 1 / 1000e9)  # tests/test_auto_link.py's emulated link


def loaded(split: str, backend: str, shardable: bool = True, everywhere: bool = False):
    return auto_rule.modes_to_load("auto", split == "width", backend, shardable, everywhere)


def choose(batch, ranks, backend, split, link, dense=DENSE[1], shape=TINY, shardable=True, everywhere=False):
    return auto_rule.auto_choice(loaded(split, backend, shardable, everywhere), batch, ranks, backend, split,
                             AutoInputs(link, dense, shape))


@pytest.mark.parametrize("backend", ["mpi", "nccl"])
@pytest.mark.parametrize("split", ["whole", "width"])
@pytest.mark.parametrize("shardable", [True, False])
@pytest.mark.parametrize("everywhere", [False, True])
def test_on_a_fast_link_it_is_the_rule_measured_on_one_host(backend, split, shardable, everywhere):
    for link in FAST:
        for dense in DENSE:
            for ranks in (2, 3, 4):
                for batch in range(1, 8 * ranks + 3):
                    names = loaded(split, backend, shardable, everywhere)
                    rule = auto_rule.auto_mode(batch, ranks, backend, split, auto_rule.row_mode(names))
                    expect = rule if rule in names else names[0]
                    got = choose(batch, ranks, backend, split, link, dense, shardable=shardable,
                                 everywhere=everywhere)
                    assert got.mode == expect, (link, dense, ranks, batch, got.describe())


def test_a_slow_link_runs_fewer_collectives_per_step():
    """One sequence per rank: dp on a fast link (each rank runs half the
    rows), collective on a slow one (one all_sum per MoE layer where dp runs
    an all_gather and an all_sum)."""
    assert choose(2, 2, "mpi", "whole", FAST[1]).mode == "dp"
    slow = choose(2, 2, "mpi", "whole", SLOW)
    assert slow.mode == "collective"
    steps = {e.mode: e for e in slow.estimates}
    assert (steps["collective"].collectives, steps["dp"].collectives) == (3, 6)
    assert steps["dp"].wire == pytest.approx(2 * steps["collective"].wire, rel=1e-3)


def test_experts_cut_in_width_one_sequence_splits_attention_only_on_a_fast_link():
    """collective-tp runs two all_sums in every layer, collective one per MoE layer."""
    assert choose(1, 2, "mpi", "width", FAST[1]).mode == "collective-tp"
    assert choose(1, 2, "mpi", "width", SLOW).mode == "collective"
    assert choose(2, 2, "mpi", "width", SLOW).mode == "collective"


def test_bytes_bring_dp_back_for_large_batches():
    """Qwen3-30B-A3B's shapes on 10 GbE, a rank's dense work 10 ms + 0.15 ms
    a row: collective's all_sum of [b, K, D] grows K times faster than dp's
    rows, so past a few sequences dp's bytes outweigh its second collective."""
    dense = DenseCost(10e-3, 0.15e-3)
    runs = {b: choose(b, 2, "mpi", "whole", TEN_GBE, dense, QWEN3_30B).mode for b in (2, 4, 8, 16, 32, 64)}
    assert runs == {2: "collective", 4: "collective", 8: "dp", 16: "dp", 32: "dp", 64: "dp"}, runs
    # Without the bytes (an infinitely wide link of the same latency) collective would keep every batch here.
    wide = LinkCost(TEN_GBE.latency, 0.0)
    assert {choose(b, 2, "mpi", "whole", wide, dense, QWEN3_30B).mode for b in (2, 8, 64)} == {"collective"}


def test_dp_is_never_a_candidate_below_its_rows_per_rank():
    """Below one row per rank (eight on NCCL with whole experts) no link makes
    auto run dp: collective is exact there and dp's ranks would idle."""
    cheap_bytes_dear_compute = LinkCost(0.0, 1e-6)
    for batch, ranks, backend in ((1, 2, "mpi"), (3, 4, "mpi"), (15, 2, "nccl")):
        got = choose(batch, ranks, backend, "whole", cheap_bytes_dear_compute, DenseCost(0.0, 1.0))
        assert [e.mode for e in got.estimates] == ["collective"]


def test_estimates_follow_the_traffic_model():
    inputs = AutoInputs(LinkCost(LOCAL.latency + 1e-3, LOCAL.seconds_per_byte), DenseCost(1.0, 0.5, 0.5), TINY)
    coll = estimate("collective", 4, 2, "whole", inputs)
    dp = estimate("dp", 4, 2, "whole", inputs)
    tp = estimate("collective-tp", 4, 2, "width", inputs)
    assert (coll.dense, dp.dense, tp.dense) == (3.0, 2.0, 3.0 * 0.75)
    assert (coll.collectives, dp.collectives, tp.collectives) == (3, 6, 6)
    assert coll.wire == pytest.approx(3e-3) and dp.wire == pytest.approx(6e-3)
    assert coll.total == coll.dense + coll.wire


def test_the_choice_says_what_it_was_chosen_from():
    inputs = AutoInputs(SLOW, DENSE[1], TINY)
    text = auto_rule.auto_choice(["collective", "dp"], 2, 2, "mpi", "whole", inputs).describe()
    assert text.startswith("auto: b = 2 on 2 ranks runs collective; per step: collective ")
    assert "dp " in text and "6 collectives" in text
    assert "50000 us per collective" in inputs.describe()


def test_every_expert_everywhere_one_sequence_splits_the_dense_part_where_the_link_allows():
    """The whole model on every rank: one sequence runs collective-tp (half
    the dense work a rank on two, every token's slots balanced by position)
    over a fast link and 10 GbE, and alone on each rank (replicas: nothing on
    the wire) over a slow one; NCCL loads no twin; batches run as replicas
    whatever the link."""
    names = loaded("whole", "mpi", everywhere=True)
    assert names == ["collective", "collective-tp", "replicas"]
    assert loaded("whole", "nccl", everywhere=True) == ["collective", "replicas"]
    assert loaded("whole", "mpi", shardable=False, everywhere=True) == ["collective", "replicas"]
    dense = DenseCost(0.4e-3, 7e-3, 1.0)  # bench-small on the 2-core CPU, as auto measured it
    shape = Shape(hidden=1024, top_k=4, layers=2, moe_layers=2, itemsize=4)
    for link in FAST + [TEN_GBE]:
        assert choose(1, 2, "mpi", "whole", link, dense, shape, everywhere=True).mode == "collective-tp"
    assert choose(1, 2, "mpi", "whole", SLOW, dense, shape, everywhere=True).mode == "replicas"
    for link in FAST + [TEN_GBE, SLOW]:
        assert choose(4, 2, "mpi", "whole", link, dense, shape, everywhere=True).mode == "replicas"


def test_one_sequence_runs_alone_where_the_link_costs_more_than_splitting_saves():
    """Qwen3-30B-A3B at 4 bits on every rank, with an Apple GPU's work (the
    dense part 0.75 ms a token, an expert slot 3 us: ~800 GB/s): over 10 GbE
    or Thunderbolt 5 one sequence runs alone on a rank (its 1.9 ms of work
    against collective-tp's 96 collectives), over one host's link the rule
    measured there (collective-tp); with fewer sequences than ranks, those
    with one run alone. The work counted for running alone is never less than
    the rule's, so no link as fast as one host's moves it there."""
    dense = DenseCost(0.7e-3, 0.05e-3, 0.5)
    tb5 = LinkCost(211e-6, 1 / 7.4e9)  # the benchmark's tb5-rdma preset
    inputs = lambda link: AutoInputs(link, dense, QWEN3_30B, expert_slot=3e-6)  # noqa: E731
    names = loaded("whole", "mpi", everywhere=True)
    for link, expect in ((FAST[1], "collective-tp"), (LOCAL, "collective-tp"), (TEN_GBE, "replicas"),
                         (tb5, "replicas")):
        got = auto_rule.auto_choice(names, 1, 2, "mpi", "whole", inputs(link))
        assert got.mode == expect, got.describe()
    got = auto_rule.auto_choice(names, 3, 4, "mpi", "whole", inputs(TEN_GBE))
    alone, rule = (next(e for e in got.estimates if e.mode == s) for s in ("replicas", "collective-tp"))
    assert got.mode == "replicas" and alone.wire == 0 and alone.collectives == 0
    assert alone.experts == pytest.approx(48 * 8 * 3e-6) and rule.experts == pytest.approx(48 * 8 * 3 / 4 * 3e-6)
    cheap_alone = AutoInputs(LOCAL, DenseCost(0.0, 1e-3), QWEN3_30B)  # running alone does less work here
    assert auto_rule.auto_choice(names, 3, 4, "mpi", "whole", cheap_alone).mode == "collective-tp"
