"""model/fit.py: the KV reserve as mlx-lm's own cache holds it, measured on
the four flagship models built from their published configs
(tests/configs/*.json, lazily: no weights), against sizes computed by hand;
a refusal's line; --kv-reserve-tokens refused where it is not a number of
tokens. The load and the doctor agreeing is tests/test_memory_fit.py's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

CONFIGS = Path(__file__).parent / "configs"

# Bytes a token adds to mlx-lm's cache at bf16 (2 bytes a value), by hand from each config:
# DeepSeek-V3 and Kimi K2 (MLA): 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2.
# Qwen3-235B-A22B: 94 layers x (keys + values) 2 x 4 KV heads x head_dim 128 x 2.
# gpt-oss-120b: 18 full-attention layers x 2 x 8 KV heads x 64 x 2; its 18 sliding layers
# (window 128) add 2 x 8 x 64 x 2 = 2,048 bytes a token each, up to 128 tokens.
PER_TOKEN = {"deepseek-v3": 61 * 576 * 2, "kimi-k2": 61 * 576 * 2, "qwen3-235b-a22b": 94 * 2 * 4 * 128 * 2,
             "gpt-oss-120b": 18 * 2 * 8 * 64 * 2}
WINDOWED = {"gpt-oss-120b": 18 * 2048 * 128}  # bytes the sliding layers hold at most


@pytest.fixture(scope="module")
def flagship():
    """name -> (lazy 4-bit model, config), built from the published config."""
    from mlxdist.model.fit import model_from_config

    return {name: model_from_config(json.loads((CONFIGS / f"{name}.json").read_text()), 4) for name in PER_TOKEN}


@pytest.mark.parametrize("name", sorted(PER_TOKEN))
def test_kv_reserve_is_what_mlx_lms_cache_holds(flagship, name):
    from mlxdist.model.fit import KvReserve, cache_cost

    model, config = flagship[name]
    cost = cache_cost(model, config)
    assert cost.measured, cost.source
    assert cost.bytes_per_token == PER_TOKEN[name]
    assert KvReserve(32768, cost).bytes == 32768 * PER_TOKEN[name] + WINDOWED.get(name, 0)
    assert cost.bytes_for(100) == 100 * PER_TOKEN[name] + WINDOWED.get(name, 0) * 100 // 128


def test_the_numbers_written_by_hand():
    assert PER_TOKEN == {"deepseek-v3": 70272, "kimi-k2": 70272, "qwen3-235b-a22b": 192512, "gpt-oss-120b": 36864}


def test_the_config_formula_where_the_cache_cannot_be_measured():
    """A module that is no mlx-lm language model: the formula, saying why (MLA counted as its latents)."""
    import mlx.nn as nn

    from mlxdist.model.fit import cache_cost

    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    cost = cache_cost(nn.Linear(2, 2), config)
    assert not cost.measured and cost.source.startswith("the config's formula (mlx-lm's cache could not be measured")
    assert cost.bytes_per_token == 61 * 576 * 2


def test_a_refusal_names_the_rank_the_numbers_and_the_ways_out(flagship):
    """DeepSeek-V3 at 4 bits on four 128 GB Macs at macOS's default GPU share (75 %) does not fit;
    on four 192 GB Macs it does (the reserve of 32,768 tokens is 2.3 GB, not the 57.3 GB that
    layers x 2 x kv_heads x head_dim counted)."""
    from mlxdist.errors import UserError
    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.model.fit import KvReserve, ModelWeights, cache_cost, check_fits, mac_memory, plan_fit

    model, config = flagship["deepseek-v3"]
    weights = ModelWeights.of(model, find_switch_sites(model))
    kv = KvReserve(32768, cache_cost(model, config))
    _, fits = plan_fit([mac_memory(192, 0.75)] * 4, weights, [True] * 4, kv)
    check_fits(fits)
    _, fits = plan_fit([mac_memory(128, 0.75)] * 4, weights, [True] * 4, kv)
    assert not any(f.fits for f in fits)
    with pytest.raises(UserError) as refused:
        check_fits(fits)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("rank 0 (host mac-128) needs 104 GB = weights 102 GB (dense 9.78 GB + 3712 experts 92 GB)")
    assert "+ KV 2.3 GB for 32768 tokens; has 92.8 GB (103 GB from 75% of 128 GB, less a 10% margin)" in line
    for way in ("--rank-memory", "--expert-capacity N", "--kv-reserve-tokens N", "more ranks"):
        assert way in line, way
    assert line.endswith("sudo sysctl iogpu.wired_limit_mb=117964")  # 90 % of 128 GiB, in MiB


def test_a_budget_by_hand_counts_expert_weights_only():
    from mlxdist.model.fit import ModelWeights, RankMemory, KvReserve, CacheCost, plan_fit
    from mlxdist.values.placement import Placement

    weights = ModelWeights(10**9, {0: 0.5e9, 1: 0.5e9}, {0: 4, 1: 4})
    memory = [RankMemory(1, "x", "h0"), RankMemory(1, "x", "h1")]
    kv = KvReserve(10, CacheCost(((10**8, None),), 0, "x"))
    plan, fits = plan_fit(memory, weights, [True, True], kv, budgets_gb=[2.0, 1.5])
    assert plan == Placement.even({0: 4, 1: 4}, 2) and fits[0].fits and not fits[1].fits
    assert fits[1].refusal().startswith("rank 1 holds 4 experts: 2 GB of expert weights, over its --rank-memory "
                                        "1.5 GB by 0.5 GB: the model does not fit. Ways out:")


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8", 1 << 31])
def test_kv_reserve_tokens_must_be_a_number_of_tokens(bad):
    from mlxdist.config import LoadOptions
    from mlxdist.errors import UserError

    with pytest.raises(UserError, match="--kv-reserve-tokens takes a number of tokens from 1 to"):
        LoadOptions("m", kv_reserve_tokens=bad).validate()


@pytest.mark.parametrize("bad", ["0", "-5", "lots", "", "99999999999999999999"])
def test_the_flag_refuses_in_one_line(bad):
    proc = subprocess.run([sys.executable, "-m", "mlxdist.run", "-p", "hi", "--kv-reserve-tokens", bad],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode != 0 and len(errors) == 1 and "--kv-reserve-tokens" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_table_of_docs_memory_md_is_the_functions():
    """docs/memory.md's table is what python -m mlxdist.model.fit prints for the four configs."""
    configs = [str(CONFIGS / f"{n}.json") for n in ("deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "gpt-oss-120b")]
    out = subprocess.run([sys.executable, "-m", "mlxdist.model.fit", "--config", *configs], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = (ROOT / "docs" / "memory.md").read_text()
    assert out.stdout.strip() in doc.replace("tests/configs/", "")


def test_every_moe_model_type_of_mlx_lm_is_measured_without_side_effects():
    """Every MoE model type of the installed mlx-lm as a tiny model: its cache is measured on the model
    (deepseek_v41's LayerCache grows through its state, not update_and_fetch: the formula, saying so),
    and the measuring forward leaves the model's output unchanged."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxdist.compat import model_classes
    from mlxdist.model.fit import cache_cost
    from mlxdist.synth import TINY_MODELS, tiny_config

    formula = {"deepseek_v41"}
    measured = []
    for model_type in sorted(TINY_MODELS):
        config = tiny_config(model_type)
        model_class, args_class = model_classes(config)
        model = model_class(args_class.from_dict(config))
        tokens = mx.array([[1, 2, 3]])
        try:
            before = model(tokens, cache=make_prompt_cache(model))
            mx.eval(before)
        except (ValueError, RuntimeError) as e:  # a kernel written for Metal only (muse_spark): mlx-lm cannot run it
            assert "Metal" in str(e), (model_type, e)
            continue
        cost = cache_cost(model, config)
        assert cost.measured == (model_type not in formula), (model_type, cost.source)
        assert cost.bytes_per_token > 0, model_type
        assert mx.array_equal(model(tokens, cache=make_prompt_cache(model)), before), model_type
        measured.append(model_type)
    assert len(measured) >= 50, measured
