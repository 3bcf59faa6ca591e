"""Capacity-limited ranks (--expert-capacity): a rank keeps only that many of
its experts resident per layer and pages the others in from its checkpoint
copy. Generation stays bit-exact with mlx-lm at every capacity, including one
slot (rounds of one expert), in the compact collective layout and in p2p."""

import numpy as np
import pytest

from conftest import last_json, launch
from shared_launch import declare, result
from test_exact import MAX_TOKENS, PROMPT, reference

CHECKPOINTS = [("qwen3_moe", None), ("mixtral", 4), ("gpt_oss", None)]
# (dispatch, ranks, capacity) of test_paged_generation_is_exact; capacity 1000: every expert resident
PAGED = [("collective", 2, 1), ("collective", 2, 3), ("p2p", 3, 2)]
FULL = ("collective", 2, 1000)


def paged_run(dispatch, capacity, checkpoints):
    """A paged_each run on ``checkpoints`` ((arch, bits) pairs), for ``shared_launch.declare``."""
    return lambda checkpoint, _: (("paged_each", [dispatch, capacity, PROMPT, MAX_TOKENS,
                                                  *(checkpoint(a, b) for a, b in checkpoints)]), lambda got: got)


def _declare() -> None:
    """This module's runs, in the session's launches (shared_launch.py)."""
    for dispatch, nranks, capacity in PAGED:
        declare(__name__, nranks, f"paging {dispatch} {capacity}", paged_run(dispatch, capacity, CHECKPOINTS))
    dispatch, nranks, capacity = FULL
    declare(__name__, nranks, f"paging {dispatch} {capacity}", paged_run(dispatch, capacity, [("qwen3_moe", None)]))


_declare()


def run(request, dispatch, nranks, capacity):
    """paged_each.py's result for (dispatch, nranks, capacity), declared above,
    from the session's launch at ``nranks`` ranks."""
    return result(request, nranks, f"paging {dispatch} {capacity}")


@pytest.mark.parametrize("dispatch,nranks,capacity", PAGED)
def test_paged_generation_is_exact(request, checkpoint, dispatch, nranks, capacity):
    got = run(request, dispatch, nranks, capacity)
    for arch, bits in CHECKPOINTS:
        path = str(checkpoint(arch, bits))
        tokens, logprobs = reference(checkpoint(arch, bits))
        assert got[path]["tokens"] == tokens, arch
        assert np.array_equal(np.array(got[path]["logprobs"]), logprobs), arch
        paging = [p for p in got[path]["paging"] if p and p["calls"]]
        assert paging, arch  # some rank paged
        assert all(p["misses"] > 0 and p["bytes_paged_in"] > 0 and 0 <= p["hit_rate"] < 1 for p in paging), paging


def test_capacity_bounds_resident_expert_bytes(request, checkpoint):
    path = str(checkpoint("qwen3_moe", None))
    full = run(request, *FULL)[path]
    paged = run(request, "collective", 2, 1)[path]
    assert full["tokens"] == paged["tokens"]
    assert all(p["misses"] == 0 for p in full["paging"])
    assert all(q < f / 2 for q, f in zip(paged["expert_gb"], full["expert_gb"]))


@pytest.mark.parametrize("args,message", [
    (["--expert-capacity", "2", "--layout", "masked", "--mode", "collective"],
     "--expert-capacity pages experts by the routing read back on the host: use --layout compact or --mode p2p"),
    (["--expert-capacity", "0"], "--expert-capacity must be at least 1, not 0"),
])
def test_plans_that_cannot_page_are_refused(checkpoint, args, message):
    proc = launch(2, ["--model", checkpoint("qwen3_moe"), "-p", "hi", "-m", 2, *args], timeout=90)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_memory_budget_sets_the_capacity(checkpoint):
    """--memory-budget GB: what the dense weights leave, over one expert per
    layer, is the capacity (here 2 of the 6 experts each rank owns per
    layer); tokens unchanged; budgets that cannot hold the dense weights or
    one expert per layer are refused, saying by how much."""
    import json

    path = checkpoint("qwen3_moe")
    args = ["--model", path, "-p", "a budget", "-m", 8, "--json", "--layout", "compact", "--replicate", "never"]
    full = launch(2, args)
    assert full.returncode == 0, full.stderr[-2000:]
    weights = last_json(full.stdout)["weights_gb"][0]
    owned = json.loads((path / "config.json").read_text())["num_experts"] // 2
    one_each = weights["expert"] / owned  # GB for one expert of every layer
    budget = launch(2, args + ["--memory-budget", weights["dense"] + 2.5 * one_each])
    assert budget.returncode == 0, budget.stderr[-2000:]
    got = last_json(budget.stdout)
    assert got["tokens"] == last_json(full.stdout)["tokens"]
    assert got["weights_gb"][0]["expert"] == pytest.approx(2 * one_each)
    for gb, message in ((0.9 * weights["dense"], "is below the dense weights"),
                        (weights["dense"] + 0.5 * one_each, "leaves no room for one expert per layer: one per layer needs")):
        proc = launch(2, args + ["--memory-budget", gb], timeout=90)
        assert proc.returncode != 0
        assert f"mlxdist: error: --memory-budget {gb:g} GB {message}" in proc.stderr, proc.stderr[-2000:]
