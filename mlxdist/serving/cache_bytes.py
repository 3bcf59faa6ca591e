"""``--prompt-cache-bytes``: its default, its bound and its parser, apart
from the prompt cache itself so that the command lines parse it without
importing mlx-lm (seconds)."""

import argparse
import re

DEFAULT_PROMPT_CACHE_BYTES = 8 << 30
MAX_PROMPT_CACHE_BYTES = 1 << 44  # 16 TiB: more than any machine holds
_BYTES = re.compile(r"([0-9]{1,20})([KMGT]i?B?)?\Z")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def prompt_cache_bytes_arg(text: str) -> int:
    """An argparse type for ``--prompt-cache-bytes``: a number of bytes in
    ASCII digits, optionally with K, M, G or T (powers of 1,024; ``8G``,
    ``512MiB``), from 0 (no prompt cache) to ``MAX_PROMPT_CACHE_BYTES``."""
    found = _BYTES.match(text) if isinstance(text, str) else None
    if not found:
        raise argparse.ArgumentTypeError(f"takes bytes in ASCII digits, optionally with K, M, G or T (8G, 512M), "
                                         f"not {text!r:.40}")
    value = int(found.group(1)) * (_UNITS[found.group(2)[0]] if found.group(2) else 1)
    if value > MAX_PROMPT_CACHE_BYTES:
        raise argparse.ArgumentTypeError(f"the value must be at most {MAX_PROMPT_CACHE_BYTES} (16T), not {text!r:.40}")
    return value


prompt_cache_bytes_arg.__name__ = "bytes"  # argparse names the type in its messages
