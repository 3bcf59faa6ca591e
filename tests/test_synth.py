"""mlxdist.synth writes checkpoints that plain mlx-lm loads and runs."""

import json
import sys

import mlx.core as mx
import pytest

from mlxdist import synth

TEST_PRESETS = ["tiny", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe", "olmoe", "dense"]
MOE_PRESETS = [p for p in TEST_PRESETS if p != "dense"]


def load_weights(path):
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def generate(path, max_tokens=8):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    text = mlx_lm.generate(model, tokenizer, prompt="hello world", max_tokens=max_tokens)
    return model, tokenizer, text


def test_tokenizer(tmp_path):
    from mlx_lm.utils import load_tokenizer

    synth.write_tokenizer(tmp_path)
    first = (tmp_path / "tokenizer.json").read_bytes()
    synth.write_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == first

    tok = load_tokenizer(tmp_path)
    assert len(tok._tokenizer) == synth.TOKENIZER_VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == synth.EOS_ID
    assert tok.bos_token is None
    text = "hello world, the experts are working!"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_padded_tokenizer(tmp_path):
    from mlx_lm.utils import load_tokenizer

    synth.write_tokenizer(tmp_path / "plain")
    synth.write_tokenizer(tmp_path / "padded", vocab_size=600)
    plain = load_tokenizer(tmp_path / "plain")
    padded = load_tokenizer(tmp_path / "padded")
    assert len(padded._tokenizer) == 600
    assert padded.decode([599]) == "<|reserved_599|>"
    assert padded.encode("hello world") == plain.encode("hello world")


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_preset_configs(preset):
    from mlxdist.compat import model_classes

    config = synth.PRESETS[preset]
    assert "model_type" in config and "quantization" not in config
    assert config["vocab_size"] >= synth.TOKENIZER_VOCAB
    assert config["eos_token_id"] == synth.EOS_ID
    _, args_class = model_classes(config)
    args_class.from_dict(config)


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_float32_checkpoint(tmp_path, preset):
    path = synth.write_checkpoint(tmp_path, preset)
    assert path == tmp_path
    for name in ["config.json", "model.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        assert (path / name).exists(), name
    weights = load_weights(path)
    assert all(v.dtype == mx.float32 for v in weights.values())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights)

    model, tokenizer, text = generate(path)
    assert len(text) > 0
    config = json.loads((path / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["vocab_size"] >= len(tokenizer._tokenizer)


@pytest.mark.parametrize("preset", ["tiny", "deepseek_v3", "gpt_oss", "mixtral"])
def test_quantized_checkpoint(tmp_path, preset):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    path = synth.write_checkpoint(tmp_path, preset, quantize_bits=4)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    weights = load_weights(path)
    assert {v.dtype for v in weights.values()} == {mx.float32, mx.uint32}

    model, _, text = generate(path)
    assert len(text) > 0
    switch = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert switch and all(m.bits == 4 for m in switch)


@pytest.mark.parametrize(
    "preset, key, experts",
    [
        ("qwen3_moe", "model.layers.0.mlp.switch_mlp.gate_proj.weight", 12),
        ("mixtral", "model.layers.0.block_sparse_moe.switch_mlp.gate_proj.weight", 12),
        ("deepseek_v3", "model.layers.1.mlp.switch_mlp.gate_proj.weight", 12),
        ("gpt_oss", "model.layers.0.mlp.experts.gate_proj.weight", 12),
    ],
)
def test_stacked_expert_layout(tmp_path, preset, key, experts):
    weights = load_weights(synth.write_checkpoint(tmp_path, preset))
    config = synth.PRESETS[preset]
    hidden = config["hidden_size"]
    assert weights[key].ndim == 3
    assert weights[key].shape[0] == experts and weights[key].shape[2] == hidden
    assert not any(".experts.0." in k for k in weights)
    if preset == "gpt_oss":
        assert weights[key.replace(".weight", ".bias")].shape[0] == experts
    if preset == "deepseek_v3":
        assert "model.layers.0.mlp.gate_proj.weight" in weights
        assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in weights
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights


def test_weights_are_randomized(tmp_path):
    weights = load_weights(synth.write_checkpoint(tmp_path, "gpt_oss"))
    for name, v in weights.items():
        assert mx.std(v).item() > 1e-3, name
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert abs(mx.mean(norm).item() - 1.0) < 0.1


def test_deterministic_and_seeded(tmp_path):
    a = load_weights(synth.write_checkpoint(tmp_path / "a", "tiny", seed=3))
    b = load_weights(synth.write_checkpoint(tmp_path / "b", "tiny", seed=3))
    c = load_weights(synth.write_checkpoint(tmp_path / "c", "tiny", seed=4))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    key = "model.layers.0.mlp.gate.weight"
    assert not mx.array_equal(a[key], c[key]).item()


def test_routing_varies(tmp_path, monkeypatch):
    from mlx_lm.models import switch_layers

    chosen = []
    call = switch_layers.SwitchGLU.__call__

    def record(self, x, indices):
        chosen.append(indices)
        return call(self, x, indices)

    monkeypatch.setattr(switch_layers.SwitchGLU, "__call__", record)
    _, tokenizer, text = generate(synth.write_checkpoint(tmp_path, "tiny"), max_tokens=16)
    assert len(set(tokenizer.encode(text))) > 4
    first_layer = chosen[0::2]
    experts = {e for inds in first_layer for e in inds.reshape(-1).tolist()}
    sets = {tuple(sorted(inds.reshape(-1).tolist())) for inds in first_layer[1:]}
    assert len(experts) >= 8
    assert len(sets) >= 6


def reshard(path, max_bytes):
    """Split a checkpoint's weights over files of at most ``max_bytes``, as a
    large model ships (mlx-lm's save_model shards at whole gigabytes only)."""
    weights = load_weights(path)
    (path / "model.safetensors").unlink()
    shards, size = [], 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(path / name), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_overrides_and_shards(tmp_path):
    path = synth.write_checkpoint(tmp_path, "gpt_oss", overrides={"num_hidden_layers": 3})
    reshard(path, 1 << 20)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and len(config["layer_types"]) == 3
    shards = sorted(p.name for p in path.glob("model*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (path / "model.safetensors").exists()
    generate(path)


def test_default_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXDIST_CACHE", str(tmp_path))
    first = synth.default_checkpoint()
    assert first.parent == tmp_path
    assert json.loads((first / "config.json").read_text())["model_type"] == "qwen3_moe"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert synth.default_checkpoint() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    generate(first)


def test_cli(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli"
    argv = ["synth", str(out), "--preset", "mixtral", "--bits", "4", "--layers", "1", "--seed", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    synth.main()
    assert "mixtral" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["quantization"]["bits"] == 4


def test_router_skew_favours_some_experts(tmp_path):
    """--skew: with a Zipf-like router bias the hottest experts take most of
    the routed slots; without it the load is near even."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from mlxdist.synth import write_checkpoint

    def top_share(skew):
        path = write_checkpoint(tmp_path / f"s{skew}", "gpt_oss", router_skew=skew)
        model, _ = load(str(path))
        block = model.model.layers[0].mlp
        x = mx.random.normal((512, model.args.hidden_size))
        inds = mx.argpartition(-block.router(x), kth=3, axis=-1)[:, :4]  # the block's own top-4 choice
        counts = np.bincount(np.asarray(inds).reshape(-1), minlength=block.router.weight.shape[0])
        return np.sort(counts)[::-1][:4].sum() / counts.sum()

    even, skewed = top_share(0.0), top_share(2.0)  # 4 of 12 experts: an even load gives them 1/3
    assert even < 0.45
    assert skewed > 0.55 and skewed > even + 0.2


# What mlx-lm's sanitize reads in each model's hub layout (the experts' names as the model's authors ship them).
HUB_KEYS = {
    "qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.3.down_proj.weight",
    "gpt_oss": "model.layers.0.mlp.experts.gate_up_proj_blocks",
}


def _greedy(path, max_tokens=8):
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    model, tokenizer = load(str(path))
    steps = list(stream_generate(model, tokenizer, mx.array(tokenizer.encode("hello world")), max_tokens=max_tokens))
    return [s.token for s in steps], np.stack([np.array(s.logprobs) for s in steps])


@pytest.mark.parametrize("preset", list(HUB_KEYS))
def test_hub_layout_is_the_same_model(tmp_path, preset):
    """layout="hub" writes the experts as the model's authors ship them
    (per-expert tensors; gpt-oss: fused mxfp4 blocks, gate and up rows
    interleaved, with OpenAI's quantization_config; deepseek_v3: kv_b_proj
    whole); mlx-lm loads it into the same model as the mlx-lm layout of the
    same weights: the same tokens and log-probabilities."""
    import numpy as np

    mxfp4 = {"mxfp4_experts": True} if preset == "gpt_oss" else {}
    mlx_path = synth.write_checkpoint(tmp_path / "mlx", preset, **mxfp4)
    hub_path = synth.write_checkpoint(tmp_path / "hub", preset, layout="hub")
    hub = load_weights(hub_path)
    assert HUB_KEYS[preset] in hub
    assert not [k for k in hub if "switch_mlp" in k or ".experts.gate_proj" in k]
    config = json.loads((hub_path / "config.json").read_text())
    if preset == "gpt_oss":
        blocks = hub[HUB_KEYS[preset]]
        assert blocks.dtype == mx.uint8 and blocks.shape == (12, 2 * 64, 2, 16)  # [E, 2H, D/32, 16]
        assert config["quantization_config"]["quant_method"] == "mxfp4" and "quantization" not in config
    if preset == "deepseek_v3":
        assert "model.layers.0.mlp.gate_proj.weight" in hub  # the dense first layer
        assert "model.layers.1.self_attn.kv_b_proj.weight" in hub
    mlx_tokens, mlx_logprobs = _greedy(mlx_path)
    hub_tokens, hub_logprobs = _greedy(hub_path)
    assert hub_tokens == mlx_tokens
    assert np.array_equal(hub_logprobs, mlx_logprobs)


def test_hub_layout_refusals(tmp_path):
    with pytest.raises(ValueError, match="No hub layout for 'olmoe'"):
        synth.write_checkpoint(tmp_path, "olmoe", layout="hub")
    with pytest.raises(ValueError, match="not quantized by bits"):
        synth.write_checkpoint(tmp_path, "qwen3_moe", layout="hub", quantize_bits=4)
    with pytest.raises(ValueError, match="Unknown layout"):
        synth.write_checkpoint(tmp_path, "qwen3_moe", layout="hf")


def test_cli_hub_layout(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli"
    monkeypatch.setattr(sys, "argv", ["synth", str(out), "--preset", "mixtral", "--layout", "hub", "--bits", "4"])
    synth.main()
    weights = load_weights(out)
    assert "model.layers.1.block_sparse_moe.experts.11.w3.scales" in weights
    _greedy(out, max_tokens=2)


def test_clustered_skew_favours_the_first_experts(tmp_path):
    import mlx.core as mx

    from mlxdist.synth import write_checkpoint

    path = write_checkpoint(tmp_path / "skewed", "gpt_oss", router_skew=1.5, skew_order="clustered")
    weights = {}
    for f in path.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    biases = [v for k, v in weights.items() if k.endswith("router.bias")]
    assert biases
    for bias in biases:  # expert 0 most favoured, then each next one less
        assert (bias[1:] < bias[:-1]).all().item()


def test_a_draft_cut_from_a_model_of_small_residuals_agrees_with_it(tmp_path):
    """--residual-scale 0.01 and --draft-of: the draft holds the first
    layer alone (with the embedding, norm and head) and mlx-lm's greedy
    tokens from it equal the model's: a draft that agrees by construction
    (docs/benchmarks.md). Without the small residuals they differ."""
    from mlx_lm.generate import generate_step

    import mlx_lm

    def greedy(path, prompt, n=24):
        model, tokenizer = mlx_lm.load(str(path))
        steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n)
        return [int(y) for (y, _), _ in zip(steps, range(n))]

    small = synth.write_checkpoint(tmp_path / "small", "qwen3_moe", overrides={"num_hidden_layers": 4},
                                   residual_scale=0.01)
    plain = synth.write_checkpoint(tmp_path / "plain", "qwen3_moe", overrides={"num_hidden_layers": 4})
    for target in (small, plain):
        synth.write_draft(target.parent / f"{target.name}-draft", target, layers=1)
    draft = tmp_path / "small-draft"
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    names = load_weights(draft)
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    assert set(names) <= set(load_weights(small))
    for prompt in ("hello world", "the weather today is"):
        assert greedy(small, prompt) == greedy(draft, prompt)
    assert any(greedy(plain, p) != greedy(tmp_path / "plain-draft", p) for p in ("hello world", "the weather today is"))
    with pytest.raises(ValueError, match="1..4 layers"):
        synth.write_draft(tmp_path / "bad", small, layers=5)
