"""How a synthetic checkpoint's weights lie in files: safetensors shards with
their index, and the hub layouts (``HUB_LAYOUTS``), the tensors as the
model's authors ship them, which mlx-lm's ``sanitize`` turns into its own on
load: per-expert tensors (qwen3_moe, mixtral, deepseek_v3) or gpt-oss's
fused mxfp4 ``_blocks``."""

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx


def check_hub_layout(config: Dict[str, Any], quantize_bits: Optional[int]) -> bool:
    """Refuse what has no hub layout here; True where it needs mxfp4 experts."""
    model_type = config["model_type"]
    if model_type not in HUB_LAYOUTS:
        raise ValueError(f"No hub layout for {model_type!r}; choose from {sorted(HUB_LAYOUTS)}")
    if quantize_bits is not None and model_type != "mixtral":  # mixtral's sanitize stacks scales and biases too
        raise ValueError(f"The hub layout of {model_type} is not quantized by bits (gpt_oss: mxfp4 experts)")
    return model_type == "gpt_oss"


def _per_expert(weights: Dict[str, mx.array], switch: str, names: Dict[str, str]) -> Dict[str, mx.array]:
    """``<block>.<switch>.<proj>.<k>`` [E, ...] -> ``<block>.experts.<e>.<names[proj]>.<k>`` [...]."""
    out = {}
    pattern = re.compile(rf"(.*)\.{switch}\.(\w+)\.(weight|scales|biases)$")
    for k, v in weights.items():
        m = pattern.match(k)
        if m is None or m[2] not in names:
            out[k] = v
            continue
        for e in range(v.shape[0]):
            out[f"{m[1]}.experts.{e}.{names[m[2]]}.{m[3]}"] = v[e]
    return out


_GLU = {n: n for n in ("gate_proj", "up_proj", "down_proj")}


def _hub_qwen3_moe(weights, config):
    return _per_expert(weights, "switch_mlp", _GLU)


def _hub_mixtral(weights, config):
    return _per_expert(weights, "switch_mlp", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})


def _hub_deepseek_v3(weights, config):
    """Per-expert experts, and each layer's ``kv_b_proj`` whole, as sanitize
    splits it into ``embed_q`` [h, r, nope] and ``unembed_out`` [h, v, r]."""
    out = {}
    for k, v in _per_expert(weights, "switch_mlp", _GLU).items():
        if k.endswith(".self_attn.embed_q.weight"):
            prefix = k[: -len("embed_q.weight")]
            wv = weights[prefix + "unembed_out.weight"]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)  # [h, nope + v, r]
            out[prefix + "kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        elif not k.endswith(".self_attn.unembed_out.weight"):
            out[k] = v
    return out


def _hub_gpt_oss(weights, config):
    """OpenAI's fused experts: gate and up interleaved by row in
    ``gate_up_proj_{blocks,scales,bias}``, mxfp4 weights as uint8 blocks of
    16 bytes (32 values) ``[E, rows, groups, 16]``."""
    out = {}
    for k, v in weights.items():
        prefix, _, name = k.rpartition(".experts.")
        proj, _, kind = name.partition(".")
        if not prefix or proj not in _GLU:
            out[k] = v
            continue
        if proj == "up_proj":
            continue
        if proj == "gate_proj":  # [E, H, ..] and [E, H, ..] -> [E, 2H, ..], rows g0 u0 g1 u1 ..
            up = weights[f"{prefix}.experts.up_proj.{kind}"]
            v = mx.stack([v, up], axis=2 if kind != "bias" else -1).reshape(*v.shape[:1], -1, *v.shape[2:])
            proj = "gate_up_proj"
        if kind == "weight":  # uint32 [E, rows, D/8] -> uint8 [E, rows, D/32, 16]
            v = v.view(mx.uint8).reshape(*v.shape[:2], -1, 16)
        suffix = {"weight": "_blocks", "scales": "_scales", "bias": "_bias"}[kind]
        out[f"{prefix}.experts.{proj}{suffix}"] = v
    return out


HUB_LAYOUTS = {"qwen3_moe": _hub_qwen3_moe, "mixtral": _hub_mixtral, "deepseek_v3": _hub_deepseek_v3,
               "gpt_oss": _hub_gpt_oss}


def save_weights(path: Path, weights: Dict[str, mx.array]) -> None:
    """Weights in safetensors shards with their index, as mlx-lm's save_model writes them."""
    from mlx_lm.utils import make_shards

    shards = make_shards({k: mx.contiguous(v) for k, v in weights.items()})
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(path / name), shard, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
