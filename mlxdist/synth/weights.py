"""A synthetic checkpoint's weights: every parameter drawn at random with a
scale fit for its role, routers skewed toward some experts where asked, an
output head shaped so greedy decoding varies, experts in mxfp4."""

import math
import re
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten


def _noise(shape, std: float) -> mx.array:
    # Uniform noise with the given standard deviation: three times faster
    # than mx.random.normal on the CPU, which matters for the large presets.
    a = std * math.sqrt(3.0)
    return mx.random.uniform(-a, a, shape)


def random_param(name: str, p: mx.array) -> mx.array:
    """A random value for the parameter ``name`` of ``p``'s shape: norms near
    1, biases and sinks small, matrices scaled by 1/sqrt(fan-in) (routers twice)."""
    if p.ndim == 1 and name.endswith("weight"):
        return 1.0 + _noise(p.shape, 0.1)
    if name.endswith("sinks"):
        return _noise(p.shape, 0.5)
    if name.endswith("bias") or p.ndim == 1:
        return _noise(p.shape, 0.05)
    if name.endswith("embed_tokens.weight"):
        return _noise(p.shape, 1.0)
    std = 1 / math.sqrt(p.shape[-1])
    if re.search(r"(^|\.)(gate|router)\.weight$", name):
        std *= 2.0
    return _noise(p.shape, std)


SKEW_ORDERS = ("random", "clustered")


def skew_routers(params: Dict[str, mx.array], skew: float, order: str = "random") -> None:
    """Set every router bias of ``params`` so that expert e of a layer gets
    ``-skew * log(1 + rank_e)``, its rank in a random order per layer (or, where
    ``order`` is clustered, in expert order)."""
    biases = [k for k in params if re.search(r"(^|\.)(router\.bias|e_score_correction_bias)$", k)]
    if not biases:
        raise ValueError("router_skew needs a model whose router has a bias (gpt_oss, deepseek_v3)")
    if order not in SKEW_ORDERS:
        raise ValueError(f"Unknown skew order {order!r}; choose {' or '.join(SKEW_ORDERS)}")
    for k in biases:
        experts = params[k].shape[-1]
        if order == "clustered":  # expert 0 most favoured: even blocks put the hot experts together
            rank = mx.arange(experts)
        else:
            rank = mx.argsort(mx.random.uniform(shape=(experts,)))  # this layer's order of favour
        params[k] = mx.broadcast_to(-skew * mx.log1p(rank.astype(mx.float32)), params[k].shape)


def _output_head(w: mx.array, embed: Optional[mx.array], keep_rows: mx.array) -> mx.array:
    """Shape a random ``lm_head`` so greedy decoding of a random model varies.

    Each row leans away from its token's embedding, so the token just read is
    unlikely to come out again, and the rows of ids that do not decode to
    whole printable text (special, reserved, partial UTF-8, control bytes)
    are shrunk so those ids are never the greedy choice.
    """
    if embed is not None and embed.shape == w.shape:
        w = w - 0.5 * embed / math.sqrt(w.shape[-1])
    return mx.where(keep_rows[:, None], w, 0.1 * w)


def shape_output_head(params: Dict[str, mx.array], keep_rows: mx.array) -> None:
    """``_output_head`` on the model's output head, found by name; with tied
    embeddings (no head) only the shrinking of rows that do not decode."""
    vocab = keep_rows.shape[0]
    embeds = [k for k, v in params.items() if _EMBED_RE.search(k) and v.ndim == 2 and v.shape[0] == vocab]
    heads = [k for k, v in params.items() if _HEAD_RE.search(k) and v.ndim == 2 and v.shape[0] == vocab]
    for name in heads:
        params[name] = _output_head(params[name], params[embeds[0]] if embeds else None, keep_rows)
    if not heads and embeds:
        params[embeds[0]] = _output_head(params[embeds[0]], None, keep_rows)


_HEAD_RE = re.compile(r"(^|\.)lm_head(\.linear)?\.weight$")
RESIDUAL_RE = re.compile(r"(^|\.)(o_proj|down_proj)\.weight$")  # what a block adds to the residual stream
LAYER_RE = re.compile(r"(^|\.)layers\.([0-9]+)\.")
_EMBED_RE = re.compile(r"(^|\.)(embed_tokens|word_embeddings|embeddings|wte)\.weight$")


def quantize_experts_mxfp4(model, config: Dict[str, Any]) -> None:
    """The experts' projections of ``model`` (its ``SwitchLinear`` layers)
    alone in mxfp4, as OpenAI ships gpt-oss; ``config`` says so."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    quantization = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    nn.quantize(model, **quantization, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    config["quantization"] = quantization  # mlx-lm quantizes only the layers whose scales are stored
    for _, v in tree_flatten(model.parameters()):
        mx.eval(v)
