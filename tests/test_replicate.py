"""The whole model on every rank (--replicate): where every host has room for
a whole model per rank it runs, ``auto`` puts every expert on every rank and
runs batches of at least one sequence per rank as N replicas (each rank its
own sequences through mlx-lm's model, no exchange in any MoE layer); one
sequence runs ``collective-tp`` on a split twin where mlx-lm can shard() the
model, else ``collective``. Real mpirun, float32 checkpoints,
against mlx-lm's batch_generate as the dp tests are."""

import pytest

from conftest import ROOT, last_json, launch
from shared_launch import declare, result
from test_dataparallel import ARCHS, MAX_TOKENS, TOLERANCE, TP_ARCHS, batch_run, reference


def _declare() -> None:
    declare(__name__, 2, "replicate auto", batch_run("auto", "masked", [MAX_TOKENS, MAX_TOKENS[:1]], 3, 2048, ARCHS))
    declare(__name__, 3, "replicate auto", batch_run("auto", "compact", [MAX_TOKENS], 0, 4, ["qwen3_moe"]))
    declare(__name__, 2, "replicate never", batch_run("auto::never", "masked", [MAX_TOKENS], 3, 2048, ["qwen3_moe"]))
    declare(__name__, 2, "replicate place",
            lambda checkpoint, _: (("replicate_place", [checkpoint("qwen3_moe")]), lambda got: got))


_declare()


@pytest.mark.parametrize("arch", ARCHS)
def test_batches_run_as_replicas_close_to_mlx_lm(request, checkpoint, arch):
    """2 ranks, every expert on both: five prompts (two join later) run as
    replicas, tokens equal to mlx-lm's batch_generate and log-probabilities
    within dp's tolerance; then one prompt on the same load runs
    collective-tp on a split twin where mlx-lm can shard() the model (half
    the dense work a rank), else collective; tokens equal, log-probabilities
    within the same tolerance (the reference decoded five at once)."""
    path = str(checkpoint(arch))
    batch, one = result(request, 2, "replicate auto")[path]
    ref_tokens, ref_logprobs = reference(path, len(MAX_TOKENS))
    shardable = arch in TP_ARCHS
    assert batch["loaded"] == (["collective", "collective-tp", "replicas"] if shardable else ["collective", "replicas"])
    assert batch["strategy"] == "replicas" and batch["tokens"] == ref_tokens
    worst = max(abs(a - b) for g, r in zip(batch["logprobs"], ref_logprobs) for a, b in zip(g, r))
    assert worst <= TOLERANCE
    assert one["strategy"] == ("collective-tp" if shardable else "collective") and one["tokens"] == ref_tokens[:1]
    assert max(abs(a - b) for a, b in zip(one["logprobs"][0], ref_logprobs[0])) <= TOLERANCE


def test_every_rank_holds_every_expert(request, checkpoint):
    """Replicated, each rank keeps the experts all ranks kept between them
    when they were spread (--replicate never, which runs dp)."""
    path = str(checkpoint("qwen3_moe"))
    everywhere = result(request, 2, "replicate auto")[path][0]
    spread = result(request, 2, "replicate never")[path]
    assert spread["loaded"] == ["collective", "dp"] and spread["strategy"] == "dp"
    assert spread["tokens"] == everywhere["tokens"]
    assert len(set(everywhere["expert_bytes"])) == 1
    assert everywhere["expert_bytes"][0] == sum(spread["expert_bytes"])


def test_three_ranks_and_chunked_prefill(request, checkpoint):
    """3 ranks, the compact layout, prompts prefilled 4 tokens a chunk (ranks
    with different numbers of chunks; none waits for another)."""
    path = str(checkpoint("qwen3_moe"))
    got = result(request, 3, "replicate auto")[path]
    ref_tokens, _ = reference(path, len(MAX_TOKENS))
    assert got["strategy"] == "replicas" and got["tokens"] == ref_tokens


def test_a_placement_must_keep_every_expert_everywhere(request):
    """Cluster.place under replicas: the even placement is refused in one
    line (the model stays as it was), one with every expert on every rank
    and other primaries is taken, and batches still run as replicas."""
    got = result(request, 2, "replicate place")
    assert got["refused"] and "a placement must keep every expert on every rank" in got["refused"]
    assert "\n" not in got["refused"]
    assert got["placed"] and got["strategy"] == "replicas" and all(len(t) == 4 for t in got["tokens"])


def _load(checkpoint, extra, env=None):
    args = ["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", 2, "--json", *extra]
    return launch(2, args, env=env, timeout=240)


def test_no_room_for_two_models_on_the_host_spreads_the_experts(checkpoint):
    """Two ranks on one host of (as told) 0.1 GB: room for one whole model
    (2.3 MB of weights and a 50 MB KV reserve: 32,768 tokens of its float32
    cache, within 90 % of the memory), not for two, so auto spreads the
    experts; told 0.2 GB, it replicates. --verbose says which."""
    tight = _load(checkpoint, ["--verbose"], env={"MLXDIST_TEST_MEMORY_GB": "0.1"})
    roomy = _load(checkpoint, ["--verbose"], env={"MLXDIST_TEST_MEMORY_GB": "0.2"})
    assert tight.returncode == 0 and roomy.returncode == 0, tight.stderr[-2000:] + roomy.stderr[-2000:]
    assert "every rank holds every expert" not in tight.stderr
    assert "every rank holds every expert (--replicate auto)" in roomy.stderr


@pytest.mark.parametrize("extra", [["--mode", "collective"], ["--no-rank0-experts"],
                                   ["--expert-split", "width"], ["--expert-capacity", "2", "--layout", "compact"]],
                         ids=["collective", "no-rank0", "width", "paged"])
def test_replicate_always_refuses_what_places_experts_otherwise(checkpoint, extra):
    proc = _load(checkpoint, ["--replicate", "always", *extra])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mlxdist: error:")]
    assert len(errors) == 1 and "--replicate always puts every expert on every rank under --mode auto" in errors[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_with_every_expert_everywhere_slots_go_by_position():
    """A token's K slots spread over the ranks whatever its experts (by
    expert, a token routed to experts 0 and 1 would have both computed by
    their primary, rank 0), and the graph's rule (masked layout) is the
    host's (compact)."""
    import mlx.core as mx
    import numpy as np

    from mlxdist.dispatch.ownership import LayerOwnership
    from mlxdist.values.placement import Placement

    plan = Placement.even({0: 6}, 3).everywhere()
    assert plan.on_every_rank and plan.layers[0][0] == (0, 1, 2) and plan.layers[0][5] == (2, 0, 1)
    for rank in range(3):
        ownership = LayerOwnership.build(0, plan.layers[0], rank, 3)
        assert ownership.everywhere and ownership.owned_experts.tolist() == list(range(6))
        flat = np.array([0, 1, 0, 1, 0, 1, 0])
        assert ownership.slot_owners(flat).tolist() == [0, 1, 2, 0, 1, 2, 0]
        in_graph = np.array(ownership.owned_slots(mx.array(flat.reshape(-1, 1)))).reshape(-1)
        assert (in_graph == (ownership.slot_owners(flat) == rank)).all()
    assert not LayerOwnership.build(0, [(0, 1), 1], 0, 2).everywhere


def test_a_rank_done_first_waits_for_the_others_shares(checkpoint):
    """Replicas' shares end when they end: rank 0's after one token, rank
    1's seconds later, past a watchdog timeout of two seconds (each of rank
    1's tokens takes milliseconds: a starved box leaves room). Rank 0 waits
    at the gather without being taken for a hung rank (it was: "no progress
    for 2 s"), and the batch returns both sequences."""
    timeout, long_tokens = 2, 3000
    proc = launch(2, [ROOT / "tests/scripts/uneven_shares.py", checkpoint("qwen3_moe"), timeout, long_tokens],
                  module=None, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    assert got["strategy"] == "replicas" and got["lengths"] == [1, long_tokens], got
    assert got["seconds"] > timeout, got  # rank 1's share outlasted the timeout
