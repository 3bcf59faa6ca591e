"""A checkpoint that calls a tool: greedy decoding after a chat prompt that
offers ``WEATHER_TOOL`` answers ``TOOL_CALL_TEXT`` (Qwen3's ``<tool_call>``
JSON, which mlx-lm's ``json_tools`` parser reads as ``TOOL_CALL``), then
end-of-sequence, whatever the question.

The model is bigram-like: every block's output projections are scaled near
zero (``residual_scale``, the experts' included; the layers still run), so
the hidden state reaching the output head hangs on the current token's
embedding. The head is then fitted on the hidden states of the script
itself, read from the model in a tool-offering prompt: for script tokens
s_0 .. s_n (s_0 the prompt's last token, s_n+1 end-of-sequence) and their
hidden states H = [h_0 .. h_n], the rows of the head lose their part in the
span of H, and row s_i+1 gains c * pinv(H)[:, i], so that head @ h_i is
exactly c at s_i+1 and 0 elsewhere. That needs every s_i to be a different
token, so the call is written in pieces of the tokenizer's vocabulary that
never repeat (``script_tokens``), which the detokenizer joins into the text.
``check_tool_call`` loads the written checkpoint with mlx-lm and refuses it
unless mlx-lm's own greedy generation gives the call.

    fit_tool_call_head(model, tokenizer, residual_scale)  the head, in place
    check_tool_call(path)                                 mlx-lm's greedy answer is the call, or ValueError
"""

from typing import Any, Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxdist.synth.tokenizer import EOS_ID, SPECIAL_TOKENS

WEATHER_TOOL: Dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
TOOL_CALL: Dict[str, Any] = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CALL_TEXT = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOOL_CALL_MESSAGES: List[Dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_RESIDUAL_SCALE = 0.01  # the default residual_scale of a tool-calling checkpoint
_MARGIN = 16.0  # the logit of the script's next token; every other logit is 0 on the script


def script_tokens(tokenizer, text: str, excluded: Sequence[int]) -> List[int]:
    """Token ids, all different and none in ``excluded``, whose pieces spell
    ``text`` (``tokenizer``: a TokenizerWrapper); the longest pieces first.
    ValueError where the vocabulary has no such spelling."""
    pieces: Dict[str, int] = {}
    for token_id in range(len(tokenizer.get_vocab())):
        if token_id not in excluded:
            pieces.setdefault(tokenizer.decode([token_id]), token_id)
    pieces.pop("", None)
    longest = max(map(len, pieces))
    found: List[int] = []

    def spell(at: int) -> bool:
        if at == len(text):
            return True
        for end in range(min(len(text), at + longest), at, -1):
            token_id = pieces.get(text[at:end])
            if token_id is not None and token_id not in found:
                found.append(token_id)
                if spell(end):
                    return True
                found.pop()
        return False

    if not spell(0):
        raise ValueError(f"the tokenizer cannot spell {text!r} in tokens that never repeat")
    return found


def tool_prompt(tokenizer, messages: List[Dict[str, Any]] = TOOL_CALL_MESSAGES) -> List[int]:
    """The chat prompt's tokens for ``messages`` with ``WEATHER_TOOL`` offered."""
    return tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True)


def _head_path(model: nn.Module) -> str:
    from mlx.utils import tree_flatten

    heads = [k[: -len(".weight")] for k, v in tree_flatten(model.parameters())
             if k.endswith("lm_head.weight") or k.endswith("lm_head.linear.weight")]
    if len(heads) != 1:
        raise ValueError("a tool-calling checkpoint needs a model with its own output head (lm_head; "
                         "tie_word_embeddings false)")
    return heads[0]


def _head_inputs(model: nn.Module, head_path: str, tokens: List[int]) -> mx.array:
    """[len(tokens), D]: what the output head at ``head_path`` reads at each position."""
    parent_path, _, name = head_path.rpartition(".")
    parent = _module(model, parent_path)
    head = getattr(parent, name)
    seen = {}

    class Reading(nn.Module):
        def __call__(self, x):
            seen["x"] = x
            return head(x)

    setattr(parent, name, Reading())
    try:
        mx.eval(model(mx.array(tokens)[None]))
    finally:
        setattr(parent, name, head)
    return seen["x"][0].astype(mx.float32)


def fit_tool_call_head(model: nn.Module, tokenizer) -> None:
    """Set ``model``'s output head (in place, in its own dtype) so
    that greedy decoding after ``tool_prompt`` spells ``TOOL_CALL_TEXT``,
    then ends (see the module's notes). ``tokenizer``: the checkpoint's
    TokenizerWrapper, written with ``tool_calls``."""
    prompt = tool_prompt(tokenizer)
    special = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    script = script_tokens(tokenizer, TOOL_CALL_TEXT, [prompt[-1], *special])
    head_path = _head_path(model)
    hidden = _head_inputs(model, head_path, prompt + script)[len(prompt) - 1:]  # [n, D]: s_0 .. s_n
    targets = mx.array(script + [EOS_ID])
    head = _module(model, head_path)
    w = head.weight.astype(mx.float32)  # [V, D]
    q, _ = mx.linalg.qr(hidden.T, stream=mx.cpu)  # [D, n]: an orthonormal basis of the script's states
    inverse = mx.linalg.pinv(hidden, stream=mx.cpu)  # [D, n]: hidden @ inverse = I
    w = w - (w @ q) @ q.T
    w = w.at[targets].add(_MARGIN * inverse.T)
    head.weight = w.astype(head.weight.dtype)
    mx.eval(head.weight)


def _module(model: nn.Module, path: str) -> nn.Module:
    for part in filter(None, path.split(".")):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def check_tool_call(path) -> None:
    """mlx-lm's own greedy answers from the checkpoint at ``path``, to the
    tool prompt and to the conversation that follows the call with its
    result, are ``TOOL_CALL_TEXT`` and its parser reads ``TOOL_CALL``; else
    ValueError saying what came instead."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(path))
    if not tokenizer.has_tool_calling:
        raise ValueError(f"{path}: mlx-lm finds no tool parser in its chat template")
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_CALL["name"], "arguments": dict(TOOL_CALL["arguments"])}}
    follow_up = TOOL_CALL_MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": "call_0", "content": "18 C, sunny"}]
    for messages in (TOOL_CALL_MESSAGES, follow_up):
        try:
            text = generate(model, tokenizer, tool_prompt(tokenizer, messages), max_tokens=64)
        except RuntimeError as e:  # bfloat16 experts on a CPU: MLX's gather_mm runs float32 only
            raise ValueError(f"mlx-lm cannot run the model at {path} here to check its tool call: {e}") from None
        if text != TOOL_CALL_TEXT:
            raise ValueError(f"the model at {path} answers {text[:120]!r}, not the tool call {TOOL_CALL_TEXT!r}: "
                             f"a larger --residual-scale or quantized head lets the layers decide")
    inner = TOOL_CALL_TEXT[len(tokenizer.tool_call_start):-len(tokenizer.tool_call_end)]
    if tokenizer.tool_parser(inner, [WEATHER_TOOL]) != TOOL_CALL:
        raise ValueError(f"mlx-lm's tool parser does not read {TOOL_CALL_TEXT!r} as {TOOL_CALL}")
