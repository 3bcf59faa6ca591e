"""Small random-weight checkpoints, for tests and benchmarks: in mlx-lm's
layout, or (``layout="hub"``) in the layout the model's authors ship, which
mlx-lm's ``sanitize`` turns into its own on load: per-expert tensors
(qwen3_moe, mixtral, deepseek_v3) or gpt-oss's fused mxfp4 ``_blocks``."""

import argparse
import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Union

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxdist import envs
from mlxdist.digits import arg_int, arg_number

SYNTH_VERSION = "1"
TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2
_MARKER = ".mlxdist-complete"
TINY_PREFIX = "tiny-"  # write_checkpoint(path, "tiny-<model_type>"): tiny_config(model_type)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The morning was cold and clear, and the river moved slowly past the old stone bridge.
A small boat drifted near the bank while two children watched the water and talked about
the fish they hoped to catch. Their mother called them home for breakfast, and they ran up
the hill through the tall grass, laughing and shouting all the way to the kitchen door.
Hello world! This is the first program that many people write when they learn a new language.
It prints a short greeting and then it stops. Simple programs like this one help us check
that the computer, the compiler and the tools are working together as they should.
A mixture of experts model sends each token to a few experts chosen by a small router.
Only the selected experts do any work, so the model can hold many parameters while the
cost of each step stays low. When the experts live on different machines, the tokens must
travel across the network, and the results must come back in the right order.
In the evening the market was full of people buying bread, cheese, apples and fresh flowers.
The baker had been working since four o'clock, and his hands were white with flour. He smiled
at every customer and wrapped each loaf in brown paper before handing it over the counter.
Good questions are often more useful than quick answers. What is the problem we want to solve?
Which parts of it do we already understand, and which parts are still unknown? Writing the
answers down, one line at a time, makes it much easier to see the next step and to share it.
The weather changed quickly that afternoon. Dark clouds rolled in from the west, the wind
picked up, and soon heavy rain was falling on the roofs and streets of the quiet town.
People hurried inside, and the cats found warm places under the porches to wait for the sun.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text, along with dates, times like
9:30, prices like $5.99, and small lists: first, second, third; north, south, east and west.
Every good story has a beginning, a middle and an end. The characters want something, they
face a problem, and they change along the way. Readers keep turning the pages because they
want to know what will happen next, and whether the hero will find the way back home again.
"""

# fmt: off
_TEST = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_attention_heads=8,
    num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
)
_QWEN3_MOE = dict(
    _TEST, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
    num_hidden_layers=3, head_dim=16, intermediate_size=128,
    moe_intermediate_size=64, num_experts=12, num_experts_per_tok=4,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    rope_theta=1e6,
)

PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(_QWEN3_MOE, num_hidden_layers=2, num_experts_per_tok=2),
    "qwen3_moe": _QWEN3_MOE,
    "mixtral": dict(
        _TEST, model_type="mixtral", architectures=["MixtralForCausalLM"],
        num_hidden_layers=2, intermediate_size=64, num_local_experts=12,
        num_experts_per_tok=2, rope_theta=1e6,
    ),
    "deepseek_v3": dict(
        _TEST, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
        num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=1,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=64, n_routed_experts=12, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
    ),
    "gpt_oss": dict(
        _TEST, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
        num_hidden_layers=4, head_dim=16, intermediate_size=64,
        num_local_experts=12, num_experts_per_tok=4, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_theta=150000, rms_norm_eps=1e-5,
    ),
    "qwen2_moe": dict(
        _TEST, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
        num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_experts=12,
        num_experts_per_tok=4, rope_theta=1e6,
    ),
    "olmoe": dict(
        _TEST, model_type="olmoe", architectures=["OlmoeForCausalLM"],
        num_hidden_layers=2, intermediate_size=64, num_experts=12,
        num_experts_per_tok=4, norm_topk_prob=False, rope_theta=10000.0,
    ),
    "dense": dict(
        _TEST, model_type="llama", architectures=["LlamaForCausalLM"],
        num_hidden_layers=2, intermediate_size=128, rope_theta=10000.0,
    ),
    "bench-small": dict(
        _QWEN3_MOE, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, intermediate_size=2816,
        moe_intermediate_size=512, num_experts=64, num_experts_per_tok=4,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE, vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, max_position_embeddings=40960,
    ),
}

# Tiny configs of every MoE model type mlx-lm ships, for
# ``write_checkpoint(path, "tiny-<model_type>")``: the types whose model builds
# SwitchGLU/SwitchMLP experts, the wrappers (vision-language, ...) around them,
# and dbrx. Each entry is what its type's ModelArgs needs beyond a shared base;
# ``ModelArgs.from_dict`` takes only the keys its type knows, so the base can
# name every type's expert count. A ``text_config`` entry gets the base too.
# Layer lists hold one layer of each kind a hybrid needs.
_TINY_BASE = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
    num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
    attention_bias=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
)
_MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_SLIDING = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
_GRANITE = dict(logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0, residual_multiplier=0.5)
_DSV32 = dict(_MLA, index_head_dim=16, index_n_heads=2, index_topk=8)
_GEMMA4 = dict(_SLIDING, enable_moe_block=True, top_k_experts=2, global_head_dim=16, num_kv_shared_layers=0,
               hidden_size_per_layer_input=0, vocab_size_per_layer_input=TOKENIZER_VOCAB, sliding_window_pattern=2)
_LONGCAT = dict(_MLA, attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=96, moe_topk=2,
                expert_ffn_hidden_size=32, zero_expert_num=2, num_layers=2, mla_scale_q_lora=True,
                mla_scale_kv_lora=True)
_MISTRAL4 = dict(_MLA, rope_parameters=dict(rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                            original_max_position_embeddings=4096))
_QWEN3_MOE = dict(decoder_sparse_step=1, mlp_only_layers=[])
_LINEAR_ATTN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                    shared_expert_intermediate_size=32, partial_rotary_factor=0.5)
_KDA = dict(linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2], num_heads=4, head_dim=16,
                                    short_conv_kernel_size=4), num_experts_per_token=2)

TINY_MODELS: Dict[str, Dict[str, Any]] = {
    "Klear": _QWEN3_MOE,
    "afmoe": dict(_SLIDING, num_dense_layers=0),
    "bailing_hybrid": dict(_MLA, layer_group_size=2, group_norm_size=1),
    "bailing_moe": dict(),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_v3": dict(_MLA, model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"],
                           layer_group_size=2),
    # dbrx's experts are a list of separate MLPs, not stacked ones: mlxdist refuses it.
    "dbrx": dict(d_model=64, n_layers=2, n_heads=4, ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0)),
    "deepseek": dict(),
    "deepseek_v2": dict(_MLA, rope_scaling=dict(factor=1.0, mscale_all_dim=0)),
    "deepseek_v3": dict(_MLA),
    "deepseek_v32": _DSV32,
    "deepseek_v41": dict(q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=16,
                         index_n_heads=2, index_head_dim=16, index_topk=8),
    "dots1": dict(),
    "ernie4_5_moe": dict(use_bias=False, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1),
    "exaone_moe": dict(_SLIDING, is_moe_layer=[True, True]),
    "gemma4": dict(text_config=dict(_GEMMA4, model_type="gemma4_text")),
    "gemma4_text": _GEMMA4,
    "glm4_moe": dict(use_qk_norm=True, partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(_MLA),
    "glm_moe_dsa": dict(_DSV32, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "gpt_oss": dict(_SLIDING),
    "granitemoe": dict(_GRANITE),
    "granitemoehybrid": dict(
        _GRANITE, layer_types=["mamba", "attention"], shared_intermediate_size=32, mamba_n_heads=4,
        mamba_d_head=32, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
        mamba_conv_bias=True,
    ),
    "hunyuan": dict(rope_scaling=dict(alpha=1.0, factor=1.0, type="dynamic"), moe_topk=2, num_shared_expert=1,
                    use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, cla_share_factor=2),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=0, expert_layer_period=1,
                  mamba_d_conv=4, mamba_d_state=16, mamba_expand=2),
    "kimi_k3": dict(_MLA, **_KDA),
    "kimi_k25": dict(text_config=dict(_MLA, model_type="deepseek_v3")),
    "kimi_linear": dict(_MLA, **_KDA, model_max_length=4096),
    "kimi_vl": dict(text_config=dict(_MLA, model_type="deepseek_v3")),
    "laguna": dict(mlp_layer_types=["sparse", "sparse"], shared_expert_intermediate_size=32),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], use_expert_bias=True, num_dense_layers=0,
                     norm_eps=1e-5, conv_bias=False, conv_L_cache=3),
    # llama4 routes top-1 and masks every fourth layer globally: four layers, MoE in every second.
    "llama4": dict(text_config=dict(
        num_hidden_layers=4, num_experts_per_tok=1, attention_chunk_size=4, interleave_moe_layer_step=2,
        intermediate_size_mlp=96, use_qk_norm=True, no_rope_layers=[1, 1, 1, 0],
    )),
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": dict(_LONGCAT, ngram_vocab_size_ratio=2, emb_neighbor_num=2, emb_split_num=2),
    "mellum": dict(_SLIDING, rope_parameters=dict(sliding_attention=dict(rope_theta=10000.0),
                                                  full_attention=dict(rope_theta=10000.0))),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[1, 0], moe_layer_freq=[1, 1], add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False, sliding_window_size=16, topk_method="noaux_tc",
        scoring_func="sigmoid", layernorm_epsilon=1e-6, swa_rope_theta=10000.0, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16, partial_rotary_factor=0.5,
    ),
    "minimax": dict(shared_intermediate_size=0, rotary_dim=8),
    "minimax_m3_vl": dict(text_config=dict()),
    "mistral3": dict(text_config=dict(_MISTRAL4, model_type="mistral4")),
    "mistral4": _MISTRAL4,
    "mixtral": dict(),
    # transformers (loading the tokenizer) checks muse_spark's audio width against the text's.
    "muse_spark": dict(audio_config=dict(out_hidden_size=64), text_config=dict(
        _SLIDING, post_norm_eps=1e-6, rope_parameters=dict(rope_theta=10000.0), num_shared_experts=0,
        layer_rope_theta=[10000.0, 10000.0], final_logit_softcapping=30.0, output_multiplier=1.0,
        moe_hidden_size=32,
    )),
    # nemotron_h needs a mamba ("M") and an attention ("*") layer; MoE ("E") in layers 1 and 3.
    "nemotron_h": dict(
        num_hidden_layers=4, hybrid_override_pattern=["M", "E", "*", "E"], mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, moe_shared_expert_intermediate_size=32,
    ),
    "olmoe": dict(),
    "phimoe": dict(),
    "phixtral": dict(num_vocab=TOKENIZER_VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8),
    "qwen2_moe": dict(shared_expert_intermediate_size=32),
    "qwen3_5_moe": dict(text_config=dict(_LINEAR_ATTN, rope_parameters=dict(type="default", rope_theta=10000.0))),
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_next": dict(_QWEN3_MOE, **_LINEAR_ATTN),
    "qwen3_vl_moe": dict(text_config=dict(_QWEN3_MOE, model_type="qwen3_moe")),
    "solar_open": dict(partial_rotary_factor=1.0),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=8, moe_top_k=2, share_expert_dim=32,
                    moe_layers_enum="0,1"),
}
# fmt: on


def write_tokenizer(path: Union[str, Path], vocab_size: Optional[int] = None) -> None:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``. The vocabulary has ``TOKENIZER_VOCAB`` entries;
    a larger ``vocab_size`` pads it with unreachable ``<|reserved_N|>`` tokens
    so that every id a model can emit still decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB:
        raise RuntimeError(f"Trained vocab has {tok.get_vocab_size()} tokens.")
    content = json.loads(tok.to_str())
    vocab = content["model"]["vocab"]
    for i in range(TOKENIZER_VOCAB, vocab_size or 0):
        vocab[f"<|reserved_{i}|>"] = i
    with open(path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(content, f, ensure_ascii=False)

    special = {"eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[0]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "unk_token": None,
        **special,
        "additional_special_tokens": [SPECIAL_TOKENS[1]],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump(special, f, indent=2)


def _noise(shape, std: float) -> mx.array:
    # Uniform noise with the given standard deviation: three times faster
    # than mx.random.normal on the CPU, which matters for the large presets.
    a = std * math.sqrt(3.0)
    return mx.random.uniform(-a, a, shape)


def _random_param(name: str, p: mx.array) -> mx.array:
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


def _skew_routers(params: Dict[str, mx.array], skew: float, order: str = "random") -> None:
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


def _shape_output_head(params: Dict[str, mx.array], keep_rows: mx.array) -> None:
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
_RESIDUAL_RE = re.compile(r"(^|\.)(o_proj|down_proj)\.weight$")  # what a block adds to the residual stream
_LAYER_RE = re.compile(r"(^|\.)layers\.([0-9]+)\.")
_EMBED_RE = re.compile(r"(^|\.)(embed_tokens|word_embeddings|embeddings|wte)\.weight$")


def _printable_rows(path: Path, vocab_size: int) -> mx.array:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    keep = [False] * vocab_size
    for i in range(min(vocab_size, TOKENIZER_VOCAB)):
        s = tok.decode([i])
        keep[i] = bool(s) and s.replace("\n", " ").isprintable() and "\ufffd" not in s
    return mx.array(keep)


def tiny_config(model_type: str) -> Dict[str, Any]:
    """A config of mlx-lm's ``model_type`` small enough for tests: hidden
    size 64, 2 layers (4 where the type needs more kinds of layer), 8
    experts, top-2 (top-1 where the type routes so), the synthetic
    tokenizer's vocabulary (see ``TINY_MODELS``)."""
    if model_type not in TINY_MODELS:
        raise ValueError(f"No tiny config for {model_type!r}; choose from {sorted(TINY_MODELS)}")
    entry = copy.deepcopy(TINY_MODELS[model_type])
    text = entry.pop("text_config", None)
    config = {**copy.deepcopy(_TINY_BASE), "model_type": model_type, **entry}
    if text is not None:
        config["text_config"] = {**copy.deepcopy(_TINY_BASE), "model_type": model_type, **text}
    return config


def _fix_layer_lists(config: Dict[str, Any]) -> None:
    n = config["num_hidden_layers"]
    if "layer_types" in config and len(config["layer_types"]) != n:
        pattern = ["sliding_attention", "full_attention"]
        config["layer_types"] = [pattern[i % 2] for i in range(n)]
    if "mlp_only_layers" in config:
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < n]


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
    residual_scale: float = 1.0,
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
    construction. The same arguments in either layout give the same weights
    once mlx-lm has loaded them.

    Returns:
        Path: The checkpoint directory.
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    from mlxdist.compat import model_classes as _get_classes

    if preset.startswith(TINY_PREFIX) and preset[len(TINY_PREFIX):] in TINY_MODELS:
        config = tiny_config(preset[len(TINY_PREFIX):])
    elif preset in PRESETS:
        config = copy.deepcopy(PRESETS[preset])
    else:
        raise ValueError(f"Unknown preset {preset!r}; choose from {sorted(PRESETS)} or {TINY_PREFIX}<model type>")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.update(copy.deepcopy(overrides or {}))
    _fix_layer_lists(config)
    if layout == "hub":
        mxfp4_experts = _check_hub_layout(config, quantize_bits) or mxfp4_experts
    elif layout != "mlx":
        raise ValueError(f"Unknown layout {layout!r}; choose mlx or hub")

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    write_tokenizer(path, vocab_size=config["vocab_size"])
    keep_rows = _printable_rows(path, config["vocab_size"])
    mx.random.seed(seed)
    params = {k: _random_param(k, v) for k, v in tree_flatten(model.parameters())}
    if router_skew:
        _skew_routers(params, router_skew, skew_order)
    if residual_scale != 1.0:
        params = {k: v * residual_scale if _RESIDUAL_RE.search(k) else v for k, v in params.items()}
    _shape_output_head(params, keep_rows)
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
        _quantize_experts_mxfp4(model, config)

    if layout == "hub":
        _save_weights(path, HUB_LAYOUTS[config["model_type"]](dict(tree_flatten(model.parameters())), config))
        if mxfp4_experts:  # OpenAI's form, which mlx-lm reads as mxfp4 wherever scales are stored
            config.pop("quantization")
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    else:
        save_model(path, model)
    save_config(config, path / "config.json")
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
            m = _LAYER_RE.search(name)
            if m is None or int(m.group(2)) < layers:
                weights[name] = value
    config["num_hidden_layers"] = layers
    for key in ("quantization", "quantization_config"):  # per-module entries of the layers cut off go too
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items()
                           if (m := _LAYER_RE.search(k)) is None or int(m.group(2)) < layers}
    _fix_layer_lists(config)
    _save_weights(path, weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def _quantize_experts_mxfp4(model, config: Dict[str, Any]) -> None:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    quantization = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    nn.quantize(model, **quantization, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    config["quantization"] = quantization  # mlx-lm quantizes only the layers whose scales are stored
    for _, v in tree_flatten(model.parameters()):
        mx.eval(v)


def _check_hub_layout(config: Dict[str, Any], quantize_bits: Optional[int]) -> bool:
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


def _save_weights(path: Path, weights: Dict[str, mx.array]) -> None:
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


def main():
    parser = argparse.ArgumentParser(
        description="Write a random-weight MoE checkpoint in mlx-lm's layout or the model's hub layout."
    )
    parser.add_argument("out_dir", help="Output directory.")
    presets = sorted(PRESETS) + [TINY_PREFIX + t for t in TINY_MODELS]
    parser.add_argument("--preset", default="qwen3_moe", choices=presets)
    parser.add_argument("--bits", type=arg_int(), default=None, help="Quantize to N bits.")
    parser.add_argument("--group-size", type=arg_int(), default=64)
    parser.add_argument("--layers", type=arg_int(), default=None, help="Number of layers.")
    parser.add_argument("--seed", type=arg_int(), default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skew", type=arg_number(), default=0.0,
                        help="Favour some experts in routing (models with a router bias: gpt_oss, deepseek_v3).")
    parser.add_argument("--skew-order", default="random", choices=SKEW_ORDERS,
                        help="Which experts --skew favours: a random order per layer, or clustered (expert 0 most, "
                             "so even blocks of experts put the hot ones on one rank).")
    parser.add_argument("--layout", default="mlx", choices=["mlx", "hub"],
                        help="mlx-lm's layout, or the one the model's authors ship (per-expert tensors; "
                             "gpt_oss: fused mxfp4 experts).")
    parser.add_argument("--mxfp4-experts", action="store_true",
                        help="Quantize the experts alone to mxfp4 (gpt-oss's form; implied by --layout hub there).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a config value (JSON), e.g. --set num_local_experts=64.")
    parser.add_argument("--residual-scale", type=arg_number(), default=1.0,
                        help="Scale what each block adds to the residual stream: well under 1 (0.01), the next token "
                             "hangs on the current one's embedding, and a --draft-of cut agrees with the model.")
    parser.add_argument("--draft-of", metavar="TARGET",
                        help="Write a speculative-decoding draft cut from the checkpoint TARGET instead: its first "
                             "--layers layers (default 1), embedding, norm, head and tokenizer.")
    args = parser.parse_args()
    if not math.isfinite(args.residual_scale):
        parser.error(f"--residual-scale must be a finite number, not {args.residual_scale}")
    if args.draft_of:
        layers = 1 if args.layers is None else args.layers
        try:
            path = write_draft(args.out_dir, args.draft_of, layers)
        except (OSError, ValueError, KeyError) as e:  # no such checkpoint, a config without layers, a bad count
            parser.error(f"cannot cut a draft from {args.draft_of}: {e}")
        print(f"Wrote a {layers}-layer draft of {args.draft_of} to {path}")
        return

    overrides = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    path = write_checkpoint(
        args.out_dir,
        args.preset,
        quantize_bits=args.bits,
        group_size=args.group_size,
        seed=args.seed,
        overrides=overrides,
        dtype=args.dtype,
        router_skew=args.skew,
        skew_order=args.skew_order,
        layout=args.layout,
        mxfp4_experts=args.mxfp4_experts,
        residual_scale=args.residual_scale,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"Wrote {args.preset} to {path} ({size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
