"""Small random-weight checkpoints, for tests and benchmarks: in mlx-lm's
layout, or (``layout="hub"``) in the layout the model's authors ship, which
mlx-lm's ``sanitize`` turns into its own on load: per-expert tensors
(qwen3_moe, mixtral, deepseek_v3) or gpt-oss's fused mxfp4 ``_blocks``.

    presets.py     PRESETS, TINY_MODELS, tiny_config: the configs
    tokenizer.py   the byte-level BPE tokenizer every checkpoint carries
    weights.py     random parameters, skewed routers, the output head, mxfp4 experts
    layouts.py     safetensors shards and the hub layouts (HUB_LAYOUTS)
    toolcall.py    a model that answers a tool-offering prompt with a known tool call (--tool-call)
    checkpoint.py  write_checkpoint, write_draft, default_checkpoint
    cli.py         python -m mlxdist.synth (__main__.py)
"""

from mlxdist.synth.checkpoint import SYNTH_VERSION, default_checkpoint, write_checkpoint, write_draft
from mlxdist.synth.cli import main
from mlxdist.synth.layouts import HUB_LAYOUTS
from mlxdist.synth.presets import PRESETS, TINY_MODELS, TINY_PREFIX, tiny_config
from mlxdist.synth.tokenizer import (BOS_ID, CHAT_TEMPLATE, CORPUS, EOS_ID, SPECIAL_TOKENS, TOKENIZER_VOCAB,
                                     write_tokenizer)
from mlxdist.synth.weights import SKEW_ORDERS

__all__ = [
    "BOS_ID", "CHAT_TEMPLATE", "CORPUS", "EOS_ID", "HUB_LAYOUTS", "PRESETS", "SKEW_ORDERS", "SPECIAL_TOKENS",
    "SYNTH_VERSION", "TINY_MODELS", "TINY_PREFIX", "TOKENIZER_VOCAB", "default_checkpoint", "main", "tiny_config",
    "write_checkpoint", "write_draft", "write_tokenizer",
]
