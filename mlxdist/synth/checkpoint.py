"""Writing a synthetic checkpoint (``write_checkpoint``), a draft cut from
one (``write_draft``), and the built-in default model (``default_checkpoint``)."""

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxdist import envs
from mlxdist.synth.layouts import HUB_LAYOUTS, check_hub_layout, save_weights
from mlxdist.synth.presets import fix_layer_lists, preset_config
from mlxdist.synth.tokenizer import printable_rows, write_tokenizer
from mlxdist.synth.toolcall import TOOL_RESIDUAL_SCALE, check_tool_call, fit_tool_call_head
from mlxdist.synth.weights import (LAYER_RE, RESIDUAL_RE, quantize_experts_mxfp4, random_param, shape_output_head,
                                   skew_routers)

SYNTH_VERSION = "1"
_MARKER = ".mlxdist-complete"


def write_checkpoint(
    path: Union[str, Path],
    preset: str = "qwen3_moe",
    *,
    quantize_bits: Optional[int] = None,
    group_size: int = 64,
    seed: int = 0,
    overrides: Optional[Dict[str, Any]] = None,
    dtype: str = "float32",
    router_skew: float = 0.0,
    skew_order: str = "random",
    layout: str = "mlx",
    mxfp4_experts: bool = False,
    residual_scale: Optional[float] = None,
    tool_call: bool = False,
) -> Path:
    """Write a random-weight checkpoint of ``preset`` in mlx-lm layout, or
    in the model's hub layout (``layout="hub"``, ``HUB_LAYOUTS``).

    The model is built with mlx-lm's own classes, every parameter is drawn
    again from ``seed``, and the result is optionally quantized with
    ``mlx_lm.utils.quantize_model``. Unquantized tensors are ``dtype``
    (float32, which MLX's CPU ``gather_mm`` needs; bfloat16 as real models).
    Weights, shards and index are written by mlx-lm's own ``save_model``.
    ``router_skew`` > 0 makes routing favour some experts, as trained routers
    do: in models whose router has a bias (gpt_oss's ``router.bias``,
    DeepSeek's ``e_score_correction_bias``) expert e of a layer (in a random
    order per layer; ``skew_order="clustered"``: in expert order, the
    worst case for even contiguous blocks) gets ``-router_skew * log(1 + rank_e)``.
    ``mxfp4_experts`` quantizes the experts' projections alone to mxfp4 (the
    rest stays ``dtype``), as OpenAI ships gpt-oss; the hub layout of gpt_oss
    implies it. ``residual_scale`` multiplies what every block adds to the
    residual stream (its attention's and MLPs' output projections): well
    under 1, the next token hangs on the current one's embedding, and a
    draft cut from the model (``write_draft``) agrees with it by
    construction (default 1; ``TOOL_RESIDUAL_SCALE`` with ``tool_call``).
    ``tool_call``: a tokenizer with Qwen3's tool-call tokens and template,
    and an output head fitted so that greedy decoding after a prompt that
    offers ``WEATHER_TOOL`` answers ``TOOL_CALL_TEXT`` (``toolcall.py``),
    checked with mlx-lm once written. The same arguments in either layout
    give the same weights once mlx-lm has loaded them.

    Returns:
        Path: The checkpoint directory.
    """
    from mlx_lm.utils import load_tokenizer, quantize_model, save_config, save_model

    from mlxdist.compat import model_classes as _get_classes

    config = preset_config(preset)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.update(copy.deepcopy(overrides or {}))
    fix_layer_lists(config)
    if layout == "hub":
        mxfp4_experts = check_hub_layout(config, quantize_bits) or mxfp4_experts
    elif layout != "mlx":
        raise ValueError(f"Unknown layout {layout!r}; choose mlx or hub")

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if residual_scale is None:
        residual_scale = TOOL_RESIDUAL_SCALE if tool_call else 1.0
    write_tokenizer(path, vocab_size=config["vocab_size"], tool_calls=tool_call)
    keep_rows = printable_rows(path, config["vocab_size"])
    mx.random.seed(seed)
    params = {k: random_param(k, v) for k, v in tree_flatten(model.parameters())}
    if router_skew:
        skew_routers(params, router_skew, skew_order)
    if residual_scale != 1.0:
        params = {k: v * residual_scale if RESIDUAL_RE.search(k) else v for k, v in params.items()}
    shape_output_head(params, keep_rows)
    if tool_call:  # fitted in float32, in which MLX's CPU runs every model
        model.update(tree_unflatten(list(params.items())))
        fit_tool_call_head(model, load_tokenizer(path))
        params = dict(tree_flatten(model.parameters()))
    params = [(k, v.astype(getattr(mx, dtype))) for k, v in params.items()]
    model.update(tree_unflatten(params))
    del params
    if quantize_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, quantize_bits)
        # One tensor at a time, so at most one float32 weight is alive at once.
        for _, v in tree_flatten(model.parameters()):
            mx.eval(v)
    if mxfp4_experts:
        quantize_experts_mxfp4(model, config)

    if layout == "hub":
        save_weights(path, HUB_LAYOUTS[config["model_type"]](dict(tree_flatten(model.parameters())), config))
        if mxfp4_experts:  # OpenAI's form, which mlx-lm reads as mxfp4 wherever scales are stored
            config.pop("quantization")
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    else:
        save_model(path, model)
    save_config(config, path / "config.json")
    if tool_call:
        check_tool_call(path)
    return path


def write_draft(path: Union[str, Path], target: Union[str, Path], layers: int = 1) -> Path:
    """Write a draft model for speculative decoding cut from ``target``: its
    first ``layers`` layers and everything outside the layers (embedding,
    final norm, output head), its tokenizer. Of a model written with a small
    ``residual_scale`` it predicts the same greedy tokens (a draft that
    agrees by construction, at a fraction of the cost)."""
    target, path = Path(target), Path(path)
    config = json.loads((target / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"a draft of {target} has 1..{config['num_hidden_layers']} layers, not {layers}")
    path.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(target.glob("*.safetensors")):
        for name, value in mx.load(str(f)).items():
            m = LAYER_RE.search(name)
            if m is None or int(m.group(2)) < layers:
                weights[name] = value
    config["num_hidden_layers"] = layers
    for key in ("quantization", "quantization_config"):  # per-module entries of the layers cut off go too
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items()
                           if (m := LAYER_RE.search(k)) is None or int(m.group(2)) < layers}
    fix_layer_lists(config)
    save_weights(path, weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def default_checkpoint() -> Path:
    """Return the built-in default model, writing it on first use.

    The ``tiny`` preset lives in ``$MLXDIST_CACHE`` (or ``~/.cache/mlxdist``)
    under ``default-v<version>``. It is written into a temporary folder and
    renamed into place, so several processes may call this at once.
    """
    root = envs.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist"
    final = root / f"default-v{SYNTH_VERSION}"
    if (final / _MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-default-", dir=root))
    try:
        os.chmod(tmp, 0o755)
        write_checkpoint(tmp, "tiny")
        (tmp / _MARKER).write_text(f"preset=tiny version={SYNTH_VERSION}\n")
        for _ in range(2):
            try:
                os.rename(tmp, final)
                break
            except OSError:
                if (final / _MARKER).exists():
                    break
                # An incomplete folder from elsewhere: move it aside and retry.
                stale = root / f".stale-{uuid.uuid4().hex}"
                with contextlib.suppress(OSError):
                    os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
        else:
            raise RuntimeError(f"Could not create {final}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
