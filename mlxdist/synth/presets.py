"""The configs a synthetic checkpoint is built from: named presets
(``PRESETS``: small test models, benchmark sizes, real models' shapes) and a
tiny config of each mlx-lm MoE model type (``tiny_config``)."""

import copy
from typing import Any, Dict

from mlxdist.synth.tokenizer import BOS_ID, EOS_ID, TOKENIZER_VOCAB

TINY_PREFIX = "tiny-"  # write_checkpoint(path, "tiny-<model_type>"): tiny_config(model_type)

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


def fix_layer_lists(config: Dict[str, Any]) -> None:
    """Per-layer lists (``layer_types``, ``mlp_only_layers``) cut or grown to
    ``num_hidden_layers``."""
    n = config["num_hidden_layers"]
    if "layer_types" in config and len(config["layer_types"]) != n:
        pattern = ["sliding_attention", "full_attention"]
        config["layer_types"] = [pattern[i % 2] for i in range(n)]
    if "mlp_only_layers" in config:
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < n]


def preset_config(preset: str) -> Dict[str, Any]:
    """A copy of the config of ``preset``: a name in ``PRESETS`` or
    ``TINY_PREFIX`` + a model type of ``TINY_MODELS``."""
    if preset.startswith(TINY_PREFIX) and preset[len(TINY_PREFIX):] in TINY_MODELS:
        return tiny_config(preset[len(TINY_PREFIX):])
    if preset in PRESETS:
        return copy.deepcopy(PRESETS[preset])
    raise ValueError(f"Unknown preset {preset!r}; choose from {sorted(PRESETS)} or {TINY_PREFIX}<model type>")
