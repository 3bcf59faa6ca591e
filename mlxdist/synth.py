"""Small random-weight checkpoints in mlx-lm layout, for tests and benchmarks."""

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

SYNTH_VERSION = "1"
TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2
_MARKER = ".mlxdist-complete"

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


def _printable_rows(path: Path, vocab_size: int) -> mx.array:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    keep = [False] * vocab_size
    for i in range(min(vocab_size, TOKENIZER_VOCAB)):
        s = tok.decode([i])
        keep[i] = bool(s) and s.replace("\n", " ").isprintable() and "\ufffd" not in s
    return mx.array(keep)


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
) -> Path:
    """Write a random-weight checkpoint of ``preset`` in mlx-lm layout.

    The model is built with mlx-lm's own classes, every parameter is drawn
    again from ``seed``, and the result is optionally quantized with
    ``mlx_lm.utils.quantize_model``. Unquantized tensors are ``dtype``
    (float32, which MLX's CPU ``gather_mm`` needs; bfloat16 as real models).
    Weights, shards and index are written by mlx-lm's own ``save_model``.

    Returns:
        Path: The checkpoint directory.
    """
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(PRESETS[preset])
    config.update(copy.deepcopy(overrides or {}))
    _fix_layer_lists(config)

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    write_tokenizer(path, vocab_size=config["vocab_size"])
    keep_rows = _printable_rows(path, config["vocab_size"])
    mx.random.seed(seed)
    params = {k: _random_param(k, v) for k, v in tree_flatten(model.parameters())}
    if "lm_head.weight" in params:
        params["lm_head.weight"] = _output_head(
            params["lm_head.weight"], params.get("model.embed_tokens.weight"), keep_rows
        )
    params = [(k, v.astype(getattr(mx, dtype))) for k, v in params.items()]
    model.update(tree_unflatten(params))
    del params
    if quantize_bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, quantize_bits)
        # One tensor at a time, so at most one float32 weight is alive at once.
        for _, v in tree_flatten(model.parameters()):
            mx.eval(v)

    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def default_checkpoint() -> Path:
    """Return the built-in default model, writing it on first use.

    The ``tiny`` preset lives in ``$MLXDIST_CACHE`` (or ``~/.cache/mlxdist``)
    under ``default-v<version>``. It is written into a temporary folder and
    renamed into place, so several processes may call this at once.
    """
    root = Path(os.environ.get("MLXDIST_CACHE") or Path.home() / ".cache" / "mlxdist")
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
        description="Write a random-weight MoE checkpoint in mlx-lm layout."
    )
    parser.add_argument("out_dir", help="Output directory.")
    parser.add_argument("--preset", default="qwen3_moe", choices=sorted(PRESETS))
    parser.add_argument("--bits", type=int, default=None, help="Quantize to N bits.")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="Number of layers.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    overrides = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    path = write_checkpoint(
        args.out_dir,
        args.preset,
        quantize_bits=args.bits,
        group_size=args.group_size,
        seed=args.seed,
        overrides=overrides,
        dtype=args.dtype,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"Wrote {args.preset} to {path} ({size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
