"""The data-parallel mode (--mode dp, and auto for batches of at least one
sequence per rank): each rank decodes its own sequences, the MoE layers
exchange tokens and combine per token. Not bit-exact (the ranks' partial
sums add in another order), so: float32 checkpoints, tokens equal to mlx-lm's
batch_generate on the same prompts for 24 to 30 steps, and max |logprob
difference| of the sampled tokens <= 1e-4, on every architecture the exact
tests cover; ragged lengths and sequences joining as others finish."""

import json

import pytest

from conftest import ROOT
from shared_launch import declare, result

ARCHS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
MAX_TOKENS = [24, 30, 26, 24, 28]  # ragged: sequences finish at different steps
# (ranks, layout, completion_batch_size, prefill step): completion 0 = every
# sequence at once, 3 = two join later; a prefill step of 4 gives ranks
# different numbers of prompt chunks
CASES = [(2, "masked", 3, 2048), (3, "compact", 0, 4), (4, "compact", 3, 2048)]
TOLERANCE = 1e-4

_REFERENCE = {}


def reference(path, n):
    """mlx-lm's batch_generate alone: tokens and sampled-token logprobs."""
    if path not in _REFERENCE:
        import sys

        sys.path.insert(0, str(ROOT / "tests/scripts"))
        from batch_each import PROMPTS
        from mlx_lm import load
        from mlx_lm.generate import batch_generate

        model, tokenizer = load(str(path))
        ids = [tokenizer.encode(p) for p in PROMPTS[:n]]
        r = batch_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS[:n], return_token_ids=True,
                           return_logprobs=True)
        _REFERENCE[path] = (r.token_ids, r.logprobs)
    return _REFERENCE[path]


# Experts whole on their owners, and cut in width over the ranks (--expert-split width:
# each rank holds 1/N of every expert's and shared expert's hidden units and runs whole MoE blocks
# on every rank's rows; the layout does not apply).
WIDTH_CASES = [(2, "masked", 3, 2048), (4, "compact", 0, 4)]
RUNS = [("whole", c) for c in CASES] + [("width", c) for c in WIDTH_CASES]


# With experts cut in width, attention can be split too (mlx-lm's shard() on
# the dense layers, the MoE block summed over the ranks): tensor parallelism
# with mlxdist's experts. auto on MPI runs it for batches below one sequence
# per rank, on a second model that shares everything but the split layers.
TP_ARCHS = ["qwen3_moe", "deepseek_v3", "gpt_oss"]  # mlx-lm has shard() for these
AUTO_BATCHES = [MAX_TOKENS, MAX_TOKENS[:1], MAX_TOKENS[:3]]
MORE_BLOCK_SHAPES = ["qwen2_moe", "olmoe"]


def batch_run(dispatch, layout, lengths, completion, prefill_step, archs):
    """A batch_each run of the batches ``lengths`` (one after another on one
    load) on ``archs``' float32 checkpoints, for ``shared_launch.declare``."""

    def make(checkpoint, _):
        return ("batch_each", [dispatch, layout, "/".join(",".join(map(str, b)) for b in lengths), completion,
                               prefill_step, *(checkpoint(a) for a in archs)]), lambda got: got

    return make


def _declare() -> None:
    """This module's runs, in the session's launches (shared_launch.py), named as the tests read them."""
    for split, case in RUNS:
        nranks, layout, completion, prefill_step = case
        declare(__name__, nranks, f"dp {split} {case}", batch_run("dp" if split == "whole" else "dp:width", layout,
                                                                  [MAX_TOKENS], completion, prefill_step, ARCHS))
    declare(__name__, 2, "dp one prompt width", batch_run("dp:width", "masked", [MAX_TOKENS[:1]], 0, 2048, ARCHS))
    declare(__name__, 2, "dp more block shapes",
            batch_run("dp:width", "masked", [MAX_TOKENS], 3, 2048, MORE_BLOCK_SHAPES))
    declare(__name__, 2, "dp collective-tp:width",
            batch_run("collective-tp:width", "masked", [MAX_TOKENS], 3, 2048, TP_ARCHS))
    declare(__name__, 2, "dp auto:width",
            batch_run("auto:width", "masked", AUTO_BATCHES, 3, 2048, TP_ARCHS + ["mixtral"]))
    declare(__name__, 3, "dp auto small", batch_run("auto::never", "masked", [MAX_TOKENS[:2]], 0, 2048, ["qwen3_moe"]))
    declare(__name__, 3, "dp auto big", batch_run("auto::never", "masked", [MAX_TOKENS[:3]], 0, 2048, ["qwen3_moe"]))


_declare()


def launched(request, nranks, name):
    """Run ``name``'s result (declared above) from the session's launch at ``nranks`` ranks."""
    return result(request, nranks, f"dp {name}")


@pytest.fixture(scope="module")
def runs(request):
    return {(split, case): launched(request, case[0], f"{split} {case}") for split, case in RUNS}


@pytest.mark.parametrize("split, case", RUNS,
                         ids=lambda r: r if isinstance(r, str) else f"np{r[0]}-{r[1]}-batch{r[2] or 'all'}-prefill{r[3]}")
@pytest.mark.parametrize("arch", ARCHS)
def test_close_to_mlx_lm_batch_generate(checkpoint, runs, arch, split, case):
    path = str(checkpoint(arch))
    got = runs[split, case][path]
    ref_tokens, ref_logprobs = reference(path, len(MAX_TOKENS))
    assert got["strategy"] == "dp"
    assert got["tokens"] == ref_tokens
    assert [len(t) for t in got["tokens"]] == MAX_TOKENS
    worst = max(abs(a - b) for g, r in zip(got["logprobs"], ref_logprobs) for a, b in zip(g, r))
    assert worst <= TOLERANCE


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == 0], ids=lambda c: f"np{c[0]}")
def test_each_rank_holds_kv_caches_for_its_sequences_only(checkpoint, runs, case):
    """Every sequence admitted at once (no joins): a rank's largest KV cache
    is its share of the sequences, each of the same size here."""
    nranks = case[0]
    kv = runs["whole", case][str(checkpoint("qwen3_moe"))]["kv_cache_gb"]
    assert len(kv) == nranks and all(k > 0 for k in kv)
    live = len(MAX_TOKENS)
    per_rank = [len(range(r, live, nranks)) for r in range(nranks)]  # least-loaded admission
    per_sequence = {k / n for k, n in zip(kv, per_rank)}
    assert len(per_sequence) == 1, (kv, per_rank)


@pytest.fixture(scope="module")
def one_prompt_width(request):
    return launched(request, 2, "one prompt width")


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_cut_in_width_one_prompt_runs_collective(checkpoint, one_prompt_width, arch):
    """One prompt under dp:width runs collective over the width-cut experts
    (every rank runs the whole block with its part of each expert and of the
    shared experts; all_sum adds the parts): close to mlx-lm, not bit-equal."""
    path = str(checkpoint(arch))
    got = one_prompt_width[path]
    ref_tokens, ref_logprobs = reference(path, len(MAX_TOKENS))
    assert got["strategy"] == "collective"
    assert got["tokens"] == ref_tokens[:1]
    assert max(abs(a - b) for a, b in zip(got["logprobs"][0], ref_logprobs[0])) <= TOLERANCE


@pytest.mark.parametrize("arch", MORE_BLOCK_SHAPES)
def test_experts_cut_in_width_more_block_shapes(request, checkpoint, arch):
    """Whole blocks exchanged on two more block shapes: a shared expert scaled
    by a gate of its own (qwen2_moe) and a block that routes flattened rows
    (olmoe); close to mlx-lm's batch_generate, like the four above."""
    import sys

    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from batch_each import PROMPTS
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    path = checkpoint(arch)
    got = launched(request, 2, "more block shapes")[str(path)]
    model, tokenizer = load(str(path))
    ref = batch_generate(model, tokenizer, [tokenizer.encode(p) for p in PROMPTS[:len(MAX_TOKENS)]],
                         max_tokens=MAX_TOKENS, return_token_ids=True, return_logprobs=True)
    assert got["strategy"] == "dp" and got["tokens"] == ref.token_ids
    assert max(abs(a - b) for g, r in zip(got["logprobs"], ref.logprobs) for a, b in zip(g, r)) <= TOLERANCE


def test_auto_is_exact_below_one_sequence_per_rank(request, checkpoint):
    """auto: 2 prompts on 3 ranks run the exact collective mode (bit-equal to
    mlx-lm's batch_generate); 3 prompts on 3 ranks run dp."""
    path = str(checkpoint("qwen3_moe"))
    small = launched(request, 3, "auto small")[path]
    assert small["strategy"] == "collective"
    ref_tokens, _ = reference(path, len(MAX_TOKENS))
    assert small["tokens"] == ref_tokens[:2]
    big = launched(request, 3, "auto big")[path]
    assert big["strategy"] == "dp"
    assert big["tokens"] == ref_tokens[:3]


def test_routing_weights_are_found_for_every_moe_preset(checkpoint):
    """The weights read through the block's derivative are, bit for bit, the
    array the block itself weights its slots with (read here, in the test
    only, from the block's frame by the name each architecture gives it)."""
    import sys

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    from mlxdist.model.checkpoint import find_switch_sites, switch_extras
    from mlxdist.model.routing import activation_dtype, block_with_weights, find_router_weights

    expected = {"qwen3_moe": "scores", "mixtral": "scores", "deepseek_v3": "scores", "gpt_oss": "expert_weights",
                "qwen2_moe": "scores", "olmoe": "scores"}
    for preset, name in expected.items():
        model, _ = load(str(checkpoint(preset)))
        site = find_switch_sites(model)[0]
        config = json.loads((checkpoint(preset) / "config.json").read_text())
        dtype = activation_dtype(model)
        router = find_router_weights(site.parent, site.attr, config["hidden_size"], dtype)
        assert router.top_k == config["num_experts_per_tok"], preset
        assert router.dtype == mx.float32, preset

        switch, seen = getattr(site.parent, site.attr), {}
        taps = []

        class StandIn(nn.Module):
            def __init__(self):
                super().__init__()
                for k, v in switch_extras(switch).items():
                    setattr(self, k, v)

            def __call__(self, x, inds):
                seen["w"] = sys._getframe(1).f_locals[name]
                return taps[-1].take(x, inds)

        setattr(site.parent, site.attr, StandIn())
        try:
            x = mx.random.normal((2, 3, config["hidden_size"]), key=mx.random.key(11)).astype(dtype)
            _, tap, w = block_with_weights(lambda: site.parent(x), taps.append, x, router)
        finally:
            setattr(site.parent, site.attr, switch)
        assert w.shape == tap.inds.shape and w.dtype == seen["w"].dtype, preset
        assert mx.array_equal(w, seen["w"]).item(), preset


def test_a_block_without_router_weights_is_refused():
    """A block that sums its slots weights each by 1 (taken); one that is not
    linear in its slots, mixes the width after weighting or ignores its slots
    is refused, naming the block and why."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxdist.model.routing import RoutingWeightsNotFound, find_router_weights

    class Unweighted(nn.Module):  # sums its slots: every weight is 1
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 4)
            self.switch = nn.Identity()

        def __call__(self, x):
            inds = mx.argpartition(self.gate(x), kth=-2, axis=-1)[..., -2:]
            return self.switch(x, inds).sum(axis=-2)

    class Squared(Unweighted):  # not linear in its slots
        def __call__(self, x):
            gates = self.gate(x)
            inds = mx.argpartition(gates, kth=-2, axis=-1)[..., -2:]
            scores = mx.take_along_axis(gates, inds, axis=-1)
            return (self.switch(x, inds) ** 2 * scores[..., None]).sum(axis=-2)

    class Projected(Unweighted):  # mixes the width after weighting: no one number per slot
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(8, 8)

        def __call__(self, x):
            gates = self.gate(x)
            inds = mx.argpartition(gates, kth=-2, axis=-1)[..., -2:]
            scores = mx.take_along_axis(gates, inds, axis=-1)
            return self.out((self.switch(x, inds) * scores[..., None]).sum(axis=-2))

    class Ignoring(Unweighted):
        def __call__(self, x):
            inds = mx.argpartition(self.gate(x), kth=-2, axis=-1)[..., -2:]
            return x + 0 * self.switch(x, inds).sum(axis=-2)

    assert find_router_weights(Unweighted(), "switch", 8, mx.float32) == (2, mx.float32)
    with pytest.raises(RoutingWeightsNotFound, match="Squared: its output is not linear in its slots"):
        find_router_weights(Squared(), "switch", 8, mx.float32)
    with pytest.raises(RoutingWeightsNotFound, match="Projected: it does not weight each slot by one number"):
        find_router_weights(Projected(), "switch", 8, mx.float32)
    with pytest.raises(RoutingWeightsNotFound, match="Ignoring: its output does not depend on its slots"):
        find_router_weights(Ignoring(), "switch", 8, mx.float32)


@pytest.fixture(scope="module")
def split_attention_runs(request):
    return {dispatch: launched(request, 2, dispatch) for dispatch in ("collective-tp:width", "auto:width")}


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_collective_tp_with_experts_cut_in_width_is_close_to_mlx_lm(checkpoint, split_attention_runs, arch):
    """Ragged batch with joins, every rank on every row, attention split."""
    path = str(checkpoint(arch))
    got = split_attention_runs["collective-tp:width"][path]
    ref_tokens, ref_logprobs = reference(path, len(MAX_TOKENS))
    assert got["strategy"] == "collective-tp" and got["tokens"] == ref_tokens
    assert max(abs(a - b) for g, r in zip(got["logprobs"], ref_logprobs) for a, b in zip(g, r)) <= TOLERANCE


@pytest.mark.parametrize("arch", TP_ARCHS + ["mixtral"])
def test_auto_with_width_splits_attention_for_one_prompt_and_back(checkpoint, split_attention_runs, arch):
    """auto:width on one load: a batch (dp, whole model), one prompt (collective-tp,
    the twin; mixtral, without shard() in mlx-lm: collective), a batch again."""
    import sys

    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from batch_each import PROMPTS
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    path = str(checkpoint(arch))
    runs = split_attention_runs["auto:width"][path]
    alone = "collective" if arch == "mixtral" else "collective-tp"
    assert [r["strategy"] for r in runs] == ["dp", alone, "dp"]
    model, tokenizer = load(path)
    for got, lengths in zip(runs, AUTO_BATCHES):
        ref = batch_generate(model, tokenizer, [tokenizer.encode(p) for p in PROMPTS[:len(lengths)]],
                             max_tokens=lengths, return_token_ids=True, return_logprobs=True)
        assert got["tokens"] == ref.token_ids
        assert max(abs(a - b) for g, r in zip(got["logprobs"], ref.logprobs) for a, b in zip(g, r)) <= TOLERANCE


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_auto_twin_holds_only_the_split_layers(checkpoint, runs, split_attention_runs, arch):
    """The sharded twin shares the MoE blocks, embedding, norms and head with
    the whole model: auto holds what dp holds plus the split layers, i.e.
    exactly what splitting saved collective-tp (dense bytes, every rank)."""
    path = str(checkpoint(arch))
    whole = runs["width", WIDTH_CASES[0]][path]["dense_bytes"]
    split = split_attention_runs["collective-tp:width"][path]["dense_bytes"]
    both = split_attention_runs["auto:width"][path][0]["dense_bytes"]
    assert all(s < w for s, w in zip(split, whole))
    assert both == [w + (w - s) for w, s in zip(whole, split)]
