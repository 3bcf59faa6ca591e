"""A completion request's generation arguments (mlx-lm's
``GenerationArguments``) from its body once the schema passed it
(``schema.py``), with the server's defaults for what it leaves out: the
reading mlx-lm's handler does in its ``do_POST``, in one place for the
front (which tokenises and shapes the answer) and for the rank server's
token channel (``token_channel.py``, which generates from token ids).

    args = generation_arguments(body, Defaults(model="M", max_tokens=512, temp=0.0, top_p=1.0))
"""

from dataclasses import dataclass
from typing import Any, Dict, List

from mlxdist import compat

# The fields of a body that say how to generate (not what to generate from,
# nor how to answer): what the front passes on through the token channel.
SAMPLING_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "repetition_context_size", "presence_penalty", "presence_context_size", "frequency_penalty",
    "frequency_context_size", "xtc_probability", "xtc_threshold", "logit_bias", "logprobs", "top_logprobs",
    "seed", "stop", "num_draft_tokens",
)


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for what a request leaves out (``serve``'s
    ``--max-tokens``, ``--temp``, ``--top-p``, ``--num-draft-tokens``), and
    the model name every answer carries (any name a request gives serves
    the one model loaded)."""

    model: str
    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    num_draft_tokens: int = 3


def stop_words(body: Dict[str, Any]) -> List[str]:
    """The body's ``stop``: a list of strings (the schema checked each)."""
    stop = body.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def generation_arguments(body: Dict[str, Any], defaults: Defaults) -> Any:
    """mlx-lm's ``GenerationArguments`` of a checked body, read as mlx-lm's
    handler reads it (``max_completion_tokens`` before ``max_tokens``,
    ``logit_bias`` keys as token ids)."""
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", defaults.max_tokens)
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        logit_bias = {int(k): float(v) for k, v in logit_bias.items()}
    return compat.GenerationArguments(
        model=compat.ModelDescription(model=defaults.model, draft="default_model", adapter=None),
        sampling=compat.SamplingArguments(
            temperature=body.get("temperature", defaults.temp), top_p=body.get("top_p", defaults.top_p),
            top_k=body.get("top_k", 0), min_p=body.get("min_p", 0.0),
            xtc_probability=body.get("xtc_probability", 0.0), xtc_threshold=body.get("xtc_threshold", 0.1)),
        logits=compat.LogitsProcessorArguments(
            logit_bias=logit_bias, repetition_penalty=body.get("repetition_penalty", 0.0),
            repetition_context_size=body.get("repetition_context_size", 20),
            presence_penalty=body.get("presence_penalty", 0.0),
            presence_context_size=body.get("presence_context_size", 20),
            frequency_penalty=body.get("frequency_penalty", 0.0),
            frequency_context_size=body.get("frequency_context_size", 20)),
        stop_words=stop_words(body), max_tokens=max_tokens,
        num_draft_tokens=body.get("num_draft_tokens", defaults.num_draft_tokens),
        logprobs=body.get("logprobs", False), top_logprobs=body.get("top_logprobs", -1), seed=body.get("seed"),
        chat_template_kwargs=body.get("chat_template_kwargs"))
