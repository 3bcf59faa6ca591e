"""Every MoE model type the installed mlx-lm ships, as a tiny random checkpoint
(``synth.tiny_config``): distributed greedy generation in the exact modes
(collective in both layouts, p2p, collective with every expert call grouped by
expert) equals mlx-lm's own stream_generate in this
process, token for token and log-probability for log-probability. One mpirun
launch loads every checkpoint in turn in every mode. A type that mlx-lm itself
cannot run here is skipped with mlx-lm's own error; one that mlxdist cannot
distribute is refused at load."""

import traceback

import mlx.core as mx
import numpy as np
import pytest

from conftest import ROOT, error_lines, launch
from mlxdist.synth import TINY_MODELS, TINY_PREFIX, write_checkpoint
from shared_launch import several

PROMPT = "The quick brown fox jumps over the lazy dog because"
MAX_TOKENS = 8
# compact: the collective layout that computes owned slots only; grouped: every expert call grouped by expert
# (grouped.py, forced on the CPU as GPUs do from two slots per expert)
MODES = ["collective", "collective-compact", "p2p", "collective-grouped"]
REFUSED = {"dbrx": "(dbrx) has no MoE layers with SwitchGLU/SwitchMLP experts"}
RUNNABLE = [t for t in sorted(TINY_MODELS) if t not in REFUSED]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """model type -> its tiny checkpoint, all written once."""
    root = tmp_path_factory.mktemp("models")
    return {t: write_checkpoint(root / t, TINY_PREFIX + t) for t in sorted(TINY_MODELS)}


@pytest.fixture(scope="module")
def references(checkpoints):
    """model type -> (tokens, logprobs) from mlx-lm alone, or the reason it
    cannot run here (an mlx-lm kernel written for Metal only)."""
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    out = {}
    for t in RUNNABLE:
        model, tokenizer = load(str(checkpoints[t]))
        try:
            steps = list(stream_generate(model, tokenizer, mx.array(tokenizer.encode(PROMPT)), max_tokens=MAX_TOKENS))
        except RuntimeError as e:
            if "Metal" not in str(e):
                raise
            where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in
                          reversed(traceback.extract_tb(e.__traceback__)) if "mlx_lm" in f.filename), "?")
            out[t] = f"mlx-lm cannot run {t} on {mx.default_device()}: {e} (at {where})"
            continue
        out[t] = ([s.token for s in steps], np.stack([np.array(s.logprobs) for s in steps]))
    return out


# test_auto_runs_collective_where_dp_cannot_read_the_block: model type -> the strategy auto runs
AUTO = {"olmoe": "dp", "Klear": "dp", "gemma4_text": "collective"}


@pytest.fixture(scope="module")
def launched(checkpoints, references, tmp_path_factory):
    """One launch at N = 2: mode -> {model type: (tokens, logprobs)} for
    every mode, and "auto" -> batch_each's result for AUTO's types."""
    types = [t for t in RUNNABLE if not isinstance(references[t], str)]
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    steps = []
    for mode, out in outs.items():
        dispatch, _, layout = mode.partition("-")
        grouped = "1" if layout == "grouped" else None  # as MLXDIST_GROUPED_EXPERTS=1 at the launch
        layout = "masked" if layout in ("", "grouped") else layout
        steps.append(("generate_each", [out, dispatch, layout, PROMPT, MAX_TOKENS, *(checkpoints[t] for t in types)],
                      grouped))
    steps.append(("batch_each", ["auto::never", "masked", "6,6", 0, 2048, *(checkpoints[t] for t in AUTO)]))
    *streams, auto = several(2, steps)
    runs = {mode: {t: (summary[str(checkpoints[t])]["tokens"], np.load(out / f"{i}.npy")) for i, t in enumerate(types)}
            for (mode, out), summary in zip(outs.items(), streams)}
    return {**runs, "auto": auto}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", RUNNABLE)
def test_matches_mlx_lm(references, launched, model_type, mode):
    reference = references[model_type]
    if isinstance(reference, str):
        pytest.skip(reference)
    ref_tokens, ref_logprobs = reference
    tokens, logprobs = launched[mode][model_type]
    assert tokens == ref_tokens
    assert logprobs.shape == ref_logprobs.shape
    assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_at_load(checkpoints, model_type):
    proc = launch(0, ["--model", checkpoints[model_type], "--prompt", PROMPT, "--max-tokens", 2])
    assert proc.returncode != 0
    errors = error_lines(proc.stderr, "mlxdist: error:")
    assert len(errors) == 1 and REFUSED[model_type] in errors[0], proc.stderr[-2000:]


def test_auto_runs_collective_where_dp_cannot_read_the_block(checkpoints, launched):
    """A batch as large as the world, the experts spread (--replicate never):
    ``auto`` runs dp where the block's
    router weights can be read through it (olmoe, whose block routes
    flattened rows; Klear, which scales its routed sum by a per-token
    coefficient, refused while the weights were looked up by name),
    collective where they cannot (gemma4's block hands the routing to an
    expert wrapper), instead of refusing the model; either way mlx-lm's
    batch_generate tokens."""
    import sys

    sys.path.insert(0, str(ROOT / "tests/scripts"))
    from batch_each import PROMPTS
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    got = launched["auto"]
    for t, strategy in AUTO.items():
        path = str(checkpoints[t])
        model, tokenizer = load(path)
        ref = batch_generate(model, tokenizer, [tokenizer.encode(p) for p in PROMPTS[:2]], max_tokens=[6, 6],
                             return_token_ids=True, return_logprobs=True)
        assert got[path]["strategy"] == strategy, t
        assert got[path]["tokens"] == ref.token_ids, t
        worst = max(abs(a - b) for g, r in zip(got[path]["logprobs"], ref.logprobs) for a, b in zip(g, r))
        assert worst <= (1e-4 if strategy == "dp" else 0.0), t


def test_dp_refuses_a_block_it_cannot_read_by_name(checkpoints):
    proc = launch(2, ["--model", checkpoints["gemma4_text"], "--prompt", PROMPT, "--mode", "dp"])
    assert proc.returncode != 0
    errors = set(error_lines(proc.stderr, "mlxdist: error:"))
    assert errors == {"mlxdist: error: --mode dp cannot run gemma4_text: Experts cannot be probed as block(x) "
                      "(TypeError: Experts.__call__() missing 2 required positional arguments: 'top_k_indices' "
                      "and 'top_k_weights')"}, proc.stderr[-2000:]


@pytest.mark.parametrize("model_type", RUNNABLE)
def test_layers_found_by_structure(model_type):
    """Each expert module's layer is its decoder layer's position in the
    model's list of layers, whatever the list is called."""
    from mlxdist.compat import model_classes
    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.synth import tiny_config

    config = tiny_config(model_type)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    sites = find_switch_sites(model)
    holders = [i for i, layer in enumerate(model.layers) if any(m is s.module for s in sites
                                                                  for _, m in layer.named_modules())]
    assert [s.layer for s in sites] == holders and len(holders) >= 2


def test_layer_numbers_stay_distinct():
    """A second list of layers is numbered after the first; two expert
    modules in one layer number every site in order."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlxdist.model.checkpoint import find_switch_sites

    class Block(nn.Module):
        def __init__(self, switches: int):
            super().__init__()
            for i in range(switches):
                setattr(self, f"moe{i}", SwitchGLU(8, 8, 4))

    class Model(nn.Module):
        def __init__(self, switches: int):
            super().__init__()
            self.h = [Block(switches), nn.Linear(8, 8), Block(switches)]
            self.mtp = [Block(switches)]

    assert [(s.layer, s.path) for s in find_switch_sites(Model(1))] == [
        (0, "h.0.moe0"), (2, "h.2.moe0"), (3, "mtp.0.moe0")]
    assert [(s.layer, s.path) for s in find_switch_sites(Model(2))] == [
        (0, "h.0.moe0"), (1, "h.0.moe1"), (2, "h.2.moe0"), (3, "h.2.moe1"), (4, "mtp.0.moe0"), (5, "mtp.0.moe1")]


def test_what_the_block_reads_from_its_expert_module_stays_whole(checkpoints):
    """muse_spark hangs a norm on its expert module and reads it in its block:
    slicing the experts keeps it whole, and the distributed switch that takes
    the module's place exposes it under the same name."""
    from mlx_lm.utils import load_model

    from mlxdist.config import LoadOptions
    from mlxdist.engine import load_engine
    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import slice_experts
    from mlxdist.model.switch import DistributedSwitch
    from mlxdist.runtime.world import World

    path = checkpoints["muse_spark"]
    index = read_safetensors_index(path)
    weights = mx.load(str(path / "model.safetensors"))
    model, _ = load_model(path, lazy=True)
    site = find_switch_sites(model)[1]
    local = slice_experts(site, [6, 1], index)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stored = weights[f"{site.path}.{proj}.weight"]
        assert mx.array_equal(local[proj].weight, stored[mx.array([6, 1])]).item()
    norm = f"{site.path}.post_expert_norm.weight"
    assert mx.array_equal(local.post_expert_norm.weight, weights[norm]).item()

    engine = load_engine(World(0, 1, None), LoadOptions(str(path), mode="collective"))
    blocks = [layer.mlp for layer in engine.model.layers]
    assert all(isinstance(b.experts, DistributedSwitch) for b in blocks)
    for b, site in zip(blocks, find_switch_sites(load_model(path, lazy=True)[0])):
        assert mx.array_equal(b.experts.post_expert_norm.weight, weights[f"{site.path}.post_expert_norm.weight"]).item()
        assert "post_expert_norm" not in b.experts.experts  # held once, beside the experts
    assert engine.memory["expert_bytes"] == sum(v.nbytes for k, v in weights.items() if ".experts." in k
                                                and "post_expert_norm" not in k)


def test_an_expert_module_extra_named_like_the_switchs_own_is_refused():
    from mlxdist.dispatch import LayerOwnership, make_dispatcher
    from mlxdist.model.switch import DistributedSwitch
    from mlxdist.runtime.world import World

    owns = LayerOwnership.build(0, [0, 0], 0)
    with pytest.raises(ValueError, match="'opens_forward'"):
        DistributedSwitch(owns, None, make_dispatcher("collective", World(0, 1, None)),
                          extras={"opens_forward": mx.ones(2)})
