"""Replicas of experts: a placement may give an expert several holders, and
each routed slot is computed by exactly one of them (``dispatch/ownership.py``).
Under real mpirun, a batch with every other expert held by every rank gives
the same tokens and log-probabilities as mlx-lm's batch_generate alone: bit
for bit in collective (both layouts) and p2p, within dp's tolerance in dp."""

import sys

import numpy as np
import pytest

from conftest import ROOT, last_json
from shared_launch import declare, result
from mlxdist.dispatch.ownership import LayerOwnership

MAX_TOKENS = [6, 4, 7, 5, 6]
MODES = ["collective:masked", "collective:compact", "p2p", "dp:masked", "dp:compact",
         "collective:compact:2", "p2p::2"]  # the last two paged: two experts resident per layer
DP_TOLERANCE = 1e-4


def test_each_slot_goes_to_one_holder_in_even_runs():
    # Expert 1 on ranks 0 and 1, expert 3 on 1 then 0: its slots, in order, split in two runs.
    ownership = LayerOwnership.build(0, [0, (0, 1), 1, (1, 0)], rank=1, num_ranks=2)
    assert ownership.owned_experts.tolist() == [1, 2, 3]
    assert ownership.local_table.tolist() == [[0, 1, -1, 2], [-1, 0, 1, 2]]
    flat = np.array([1, 1, 1, 1, 3, 3, 3, 0, 2, 1])
    owners = ownership.slot_owners(flat)
    assert owners.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert ownership.slot_local(flat, owners).tolist() == [1, 1, 1, 0, 2, 2, 2, 0, 1, 0]


def test_the_graph_rule_is_the_host_rule():
    import mlx.core as mx

    rng = np.random.default_rng(0)
    for rank in range(3):
        ownership = LayerOwnership.build(0, [(0, 1, 2), 1, (2, 0), 0, (1, 2)], rank=rank, num_ranks=3)
        for _ in range(50):
            flat = rng.integers(0, 5, size=rng.integers(1, 40))
            in_graph = np.array(ownership.owned_slots(mx.array(flat.reshape(-1, 1)))).reshape(-1)
            assert (in_graph == (ownership.slot_owners(flat) == rank)).all()


def _reference(path):
    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from batch_each import PROMPTS
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    model, tokenizer = load(str(path))
    ids = [tokenizer.encode(p) for p in PROMPTS[: len(MAX_TOKENS)]]
    r = batch_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, return_token_ids=True, return_logprobs=True)
    return r.token_ids, r.logprobs


WORLDS = [(2, "qwen3_moe"), (3, "deepseek_v3"), (4, "mixtral")]


def _declare() -> None:
    """replicas_each's run of every mode for each world size, in the session's launches (shared_launch.py)."""
    for nranks, arch in WORLDS:
        declare(__name__, nranks, f"replicas {arch}", lambda checkpoint, _, arch=arch: (
            ("replicas_each", [",".join(map(str, MAX_TOKENS)), checkpoint(arch), *MODES]), lambda got: got))


_declare()


@pytest.mark.parametrize("nranks,arch", WORLDS)
def test_replicas_match_mlx_lm(request, checkpoint, nranks, arch):
    path = checkpoint(arch)
    got = result(request, nranks, f"replicas {arch}")
    ref_tokens, ref_logprobs = _reference(path)
    for mode in MODES:
        even, replicas = got[f"{mode}/even"], got[f"{mode}/replicas"]
        assert any(len(e) > len(even["held_by_rank0"][l]) for l, e in replicas["held_by_rank0"].items())
        assert replicas["tokens"] == ref_tokens, mode
        worst = max(abs(a - b) for g, r in zip(replicas["logprobs"], ref_logprobs) for a, b in zip(g, r))
        if mode.startswith("dp"):
            assert worst <= DP_TOLERANCE, mode
        else:
            assert worst == 0.0, mode
            assert replicas == {**even, "held_by_rank0": replicas["held_by_rank0"]}, mode


def test_a_lost_worker_with_replicas(checkpoint, tmp_path):
    """p2p at np = 3 with every odd expert held by every rank: kill -9 of rank
    2 mid-stream; rank 0 takes over what rank 2 held (replicas included) and
    every result equals the undisturbed run's, which equals even placement's."""
    import json

    from mlx_lm.utils import load_model

    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.values.placement import Placement
    from test_survival import SCRIPT, survive

    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from replicas_each import with_replicas

    path = checkpoint("qwen3_moe")
    sites = find_switch_sites(load_model(path, lazy=True)[0])
    even = Placement.even({s.layer: s.num_experts for s in sites}, 3).to_json()
    placement = tmp_path / "replicas.json"
    placement.write_text(json.dumps(with_replicas(even, 3)))
    undisturbed = survive(3, [SCRIPT, path, -1, 0, "even", placement], module=None)  # one job, loaded twice
    assert undisturbed.returncode == 0, undisturbed.stderr[-3000:]
    lines = [json.loads(l) for l in undisturbed.stdout.splitlines() if l.startswith("{")]
    assert len(lines) == 2, undisturbed.stdout[-2000:]
    runs = {"even": lines[0], "replicas": lines[1]}
    lost = survive(3, [SCRIPT, path, -1, 0, placement], fault="kill:rank=2,layer=-1,step=5", module=None)
    assert lost.returncode == 0, lost.stderr[-3000:]
    runs["lost"] = last_json(lost.stdout)
    assert runs["lost"]["lost"] == [2]
    for key in ("first", "second", "batch"):
        assert runs["lost"][key] == runs["replicas"][key] == runs["even"][key], key
