"""Checkpoints in the layouts the models' authors ship, which mlx-lm's
``sanitize`` turns into its own on load: per-expert tensors (qwen3_moe,
mixtral, deepseek_v3 with its dense first layer) and gpt-oss's fused mxfp4
``gate_up_proj_blocks``. Under mpirun on two ranks each rank reads from the
safetensors files only about what it keeps (``rchar`` of /proc/self/io
around the load: every read and pread, MLX's own loads included), its load
peaks within 1.25 x what it keeps, generation equals single-process mlx-lm
token for token and logit for logit, and --expert-capacity pages experts in
from the same layouts."""

import json

import numpy as np
import pytest

from conftest import ROOT, last_json, launch
from test_exact import MAX_TOKENS, PROMPT, reference

# Experts dominate (each rank keeps half of them): a rank that read every expert would read ~1.9 x its share.
OVERRIDES = {
    "qwen3_moe": dict(hidden_size=128, num_experts=16, moe_intermediate_size=256, num_hidden_layers=2),
    "mixtral": dict(hidden_size=128, num_local_experts=16, intermediate_size=256, num_hidden_layers=2),
    "deepseek_v3": dict(hidden_size=128, n_routed_experts=16, moe_intermediate_size=256, num_hidden_layers=3),
    "gpt_oss": dict(hidden_size=128, num_local_experts=32, intermediate_size=512, num_hidden_layers=2),
}
ARCHS = list(OVERRIDES)
# Read besides the weights a rank keeps: the index of content hashes, config, tokenizer.
OTHER_BYTES = 0.5e6

_RUNS = {}


@pytest.fixture(scope="module")
def hub(checkpoint):
    """The checkpoints, each file hashed once here (ship/content_hash.py), as a load after the first finds them:
    what a rank reads at load is then its share only."""
    import os
    import time

    from mlxdist.ship.fingerprint import checkpoint_digests

    paths = {arch: checkpoint(arch, layout="hub", overrides=OVERRIDES[arch]) for arch in ARCHS}
    past = time.time() - 3600  # older than content_hash.RACY: the identity is kept
    for path in paths.values():
        for f in path.iterdir():
            os.utime(f, (past, past))
        checkpoint_digests(path)
    return paths


@pytest.fixture(scope="module")
def loaded(hub, tmp_path_factory):
    """{arch: (tokens, logprobs, bytes read per rank, weights_gb per rank)}: one launch loads each in turn."""
    if "load" not in _RUNS:
        out = tmp_path_factory.mktemp("hub-load")
        paths = [str(hub[a]) for a in ARCHS]
        proc = launch(2, [ROOT / "tests/scripts/hub_each.py", out, "collective", PROMPT, MAX_TOKENS, *paths],
                      module=None, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        _RUNS["load"] = {a: (summary[p]["tokens"], np.load(out / f"{summary[p]['index']}.npy"),
                             summary[p]["bytes_read"], summary[p]["weights_gb"]) for a, p in zip(ARCHS, paths)}
    return _RUNS["load"]


@pytest.fixture(scope="module")
def paged(hub):
    if "paged" not in _RUNS:
        paths = [str(hub[a]) for a in ARCHS]
        proc = launch(2, [ROOT / "tests/scripts/paged_each.py", "collective", 2, PROMPT, MAX_TOKENS, *paths],
                      module=None, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = last_json(proc.stdout)
        _RUNS["paged"] = {a: got[p] for a, p in zip(ARCHS, paths)}
    return _RUNS["paged"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rank_reads_only_its_share_of_a_hub_layout(hub, loaded, arch):
    tokens, logprobs, bytes_read, weights = loaded[arch]
    ref_tokens, ref_logprobs = reference(hub[arch])
    assert tokens == ref_tokens
    assert np.max(np.abs(logprobs - ref_logprobs)) == 0.0
    total_experts = sum(w["expert"] for w in weights)
    for rank, (read, w) in enumerate(zip(bytes_read, weights)):
        kept = (w["expert"] + w["dense"]) * 1e9
        assert w["expert"] == pytest.approx(total_experts / 2, rel=0.01)
        assert read <= 1.02 * kept + OTHER_BYTES, (rank, read, kept)
        assert w["load_peak"] <= 1.25 * (w["expert"] + w["dense"]), (rank, w)
    assert total_experts > 3 * weights[0]["dense"]  # experts dominate: reading them all would show


@pytest.mark.parametrize("arch", ARCHS)
def test_paging_pages_experts_in_from_a_hub_layout(hub, paged, arch):
    got = paged[arch]
    tokens, logprobs = reference(hub[arch])
    assert got["tokens"] == tokens
    assert np.array_equal(np.array(got["logprobs"]), logprobs)
    paging = [p for p in got["paging"] if p and p["calls"]]
    assert paging and all(p["misses"] > 0 and p["bytes_paged_in"] > 0 for p in paging), paging


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_experts_that_sanitize_computes_are_read_for_the_owned_experts_only(tmp_path):
    """DeepSeek's fp8 per-expert weights, which sanitize dequantizes before
    stacking: only the owned experts' lazy dequantisations are evaluated, so
    only their bytes are read; they equal mlx-lm's own load. Such experts
    cannot be read again one by one: paging is refused with one line."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from mlxdist.errors import UserError
    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import slice_experts
    from mlxdist.model.paging import PagingStats, expert_module
    from mlxdist.model.sources import load_lazy
    from mlxdist.synth import write_checkpoint

    path = write_checkpoint(tmp_path, "deepseek_v3", layout="hub")
    weights = mx.load(str(path / "model.safetensors"))
    fp8 = [k for k in weights if ".mlp.experts." in k]
    for k in fp8:  # [m, n] with m, n <= 128: one block, one scale
        weights[k], weights[f"{k}_scale_inv"] = mx.to_fp8(weights[k]), mx.full((1, 1), 1.0)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "model.safetensors.index.json").unlink()
    owned = [7, 2]

    model, _, sources = load_lazy(path, read_safetensors_index(path))
    site = find_switch_sites(model)[0]
    before = _rchar()
    local = slice_experts(site, owned, sources)
    mx.eval(local.parameters())
    read = _rchar() - before
    one_expert = sum(weights[k].nbytes + 4 for k in fp8 if k.startswith(f"{site.path.rsplit('.', 1)[0]}.experts.0."))
    assert read <= 1.05 * len(owned) * one_expert, (read, one_expert)
    reference = find_switch_sites(load_model(path)[0])[0].module
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert mx.array_equal(local[proj].weight, reference[proj].weight[mx.array(owned)]).item()

    model, _, sources = load_lazy(path, read_safetensors_index(path))
    with pytest.raises(UserError, match="cannot page model.layers.1.mlp.switch_mlp: its .* cannot be read"):
        expert_module(find_switch_sites(model)[0], [0, 1, 2], sources, 1, PagingStats())
