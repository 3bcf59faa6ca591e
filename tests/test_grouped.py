"""Expert calls grouped by expert (``mlxdist/model/grouped.py``): the same bits as
mlx-lm's per-slot call, in process and under mpirun with grouping forced on
(``MLXDIST_GROUPED_EXPERTS=1``; by default it runs on GPUs only)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mlxdist.model import grouped
from mlxdist.model.grouped import CHUNK_ROWS, call_grouped, chunk_map, groups
from shared_launch import declare, grouping, result

FORCED = {"MLXDIST_GROUPED_EXPERTS": "1"}


def routing(tokens, k, experts, skewed=False, seed=0):
    rng = np.random.default_rng(seed)
    if skewed:  # every token to the same k experts: chunks overflow into more chunks per expert
        return mx.array(np.tile(np.arange(k)[::-1], (tokens, 1)).astype(np.uint32))
    return mx.array(np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.uint32))


def experts_module(kind, bits, bias=False):
    mx.random.seed(3)
    module = (SwitchGLU if kind == "glu" else SwitchMLP)(64, 128, 16, bias=bias)
    if bias:  # gpt_oss-style expert biases, not zeros
        for proj in ("gate_proj", "up_proj", "down_proj") if kind == "glu" else ("fc1", "fc2"):
            layer = getattr(module, proj)
            layer.bias = mx.random.normal(layer.bias.shape) * 0.1
    if bits:
        nn.quantize(module, group_size=64, bits=bits)
    return module


@pytest.mark.parametrize("kind", ["glu", "mlp"])
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape, k, skewed", [((5,), 4, False), ((3, 9), 4, False), ((40,), 2, True), ((1,), 1, False)])
def test_grouped_call_is_the_per_slot_call(kind, bits, bias, shape, k, skewed):
    module = experts_module(kind, bits, bias)
    tokens = int(np.prod(shape))
    x = mx.random.normal(shape + (64,), key=mx.random.key(1))
    inds = routing(tokens, k, 16, skewed).reshape(shape + (k,))
    want = module(x, inds)
    got = call_grouped(module, x, inds)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item()


def test_chunk_map_places_every_slot_once_with_its_expert():
    inds = mx.concatenate([routing(30, 3, 8), routing(20, 3, 8, skewed=True)])
    tokens, k = inds.shape
    dest, src, chunk_experts = (np.array(a) for a in chunk_map(inds, 8))
    flat = np.array(inds).reshape(-1)
    assert len(set(dest.tolist())) == flat.size  # no two slots share a row
    assert (src[dest] == np.arange(flat.size) // k).all()  # each row holds its slot's token
    assert (chunk_experts[dest // CHUNK_ROWS, 0] == flat).all()  # in a chunk of its expert
    assert len(src) == CHUNK_ROWS * (min(8, flat.size) + -(-flat.size // CHUNK_ROWS))  # the static bound
    assert (np.delete(src, dest) == tokens).all()  # every other row is padding


def test_grouping_is_chosen_on_gpus_from_two_slots_per_expert(monkeypatch):
    glu = experts_module("glu", None)
    monkeypatch.setattr(grouped, "OVERRIDE", "")  # MLXDIST_GROUPED_EXPERTS, as read at import
    many = mx.zeros((16, 2), mx.uint32)  # 32 slots over 16 experts
    assert groups(glu, many) == (mx.default_device() == mx.gpu)
    assert not groups(glu, mx.zeros((15, 2), mx.uint32))
    monkeypatch.setattr(grouped, "OVERRIDE", "1")
    assert groups(glu, mx.zeros((1, 1), mx.uint32))
    assert not groups(type("Sub", (SwitchGLU,), {})(8, 8, 4), many)  # a subclass may compute otherwise
    monkeypatch.setattr(grouped, "OVERRIDE", "0")
    assert not groups(glu, many)


def _declare() -> None:
    """This module's runs, each with every expert call grouped (FORCED), in the
    session's launch at 2 ranks (shared_launch.py): collective on test_exact's
    checkpoints; dp and dp:width on test_dataparallel's batch."""
    from test_dataparallel import ARCHS, batch_run
    from test_dataparallel import MAX_TOKENS as DP_MAX_TOKENS
    from test_exact import CHECKPOINTS, MAX_TOKENS, generated

    forced = FORCED["MLXDIST_GROUPED_EXPERTS"]
    declare(__name__, 2, "grouped collective",
            grouping(generated("collective", "masked", MAX_TOKENS, CHECKPOINTS), forced))
    for split in ("dp", "dp:width"):
        declare(__name__, 2, f"grouped {split}",
                grouping(batch_run(split, "compact", [DP_MAX_TOKENS], 3, 2048, ARCHS), forced))


_declare()


def test_exact_modes_stay_bit_exact_with_grouping(request, checkpoint):
    """Every tested architecture, float32 and 4-bit, collective on 2 ranks with every expert call grouped."""
    from test_exact import CHECKPOINTS, reference

    got = result(request, 2, "grouped collective")
    for path in [str(checkpoint(a, b)) for a, b in CHECKPOINTS]:
        ref_tokens, ref_logprobs = reference(path)
        tokens, logprobs, _ = got[path]
        assert tokens == ref_tokens, path
        assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0, path


@pytest.mark.parametrize("split", ["dp", "dp:width"])
def test_dp_with_grouping_is_close_to_mlx_lm(request, checkpoint, split):
    from test_dataparallel import ARCHS, MAX_TOKENS, TOLERANCE, reference

    got = result(request, 2, f"grouped {split}")
    for arch in ARCHS:
        path = str(checkpoint(arch))
        ref_tokens, ref_logprobs = reference(path, len(MAX_TOKENS))
        assert got[path]["tokens"] == ref_tokens, arch
        assert max(abs(a - b) for g, r in zip(got[path]["logprobs"], ref_logprobs) for a, b in zip(g, r)) <= TOLERANCE
