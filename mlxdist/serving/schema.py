"""The one schema every HTTP request body passes on rank 0 before any rank
sees it.

mlx-lm's server code, which runs the requests, trusts its input: an
out-of-range ``logit_bias`` token id is written out of bounds (a segfault on
every rank), a sampler argument out of its range raises inside the
generation loop on every rank, a request may carry its own Jinja template,
an ``image_url`` is fetched from any address. Here each field is checked
against the loaded model (its vocabulary and context) and against bounds on
the work one request may cause, and a refusal is an OpenAI-shaped 400
naming the field (``RequestError``). What passes is what mlx-lm reads.

    check_request(raw bytes, limits) -> (the parsed body, its prompt's characters), or RequestError
"""

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

from mlxdist.inputs import json_input
from mlxdist.inputs.digits import parse_int
from mlxdist.errors import RequestError
from mlxdist.inputs.json_input import MAX_DEPTH

DEFAULT_MAX_DRAFT_TOKENS = 16  # tokens a request may have drafted per verifying forward (--max-draft-tokens)
ROLES = ("system", "user", "assistant", "tool", "developer")
# apply_chat_template's own parameters: a request's chat_template_kwargs may
# only add variables for the template, never change how it is rendered.
TEMPLATE_PARAMETERS = frozenset((
    "chat_template", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "conversation",
))
# Fields mlx-lm's handler reads; any other top-level field is refused rather than ignored
# unless OpenAI clients send it routinely (then it is listed in IGNORED).
KNOWN = frozenset((
    "model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
    "xtc_probability", "xtc_threshold", "logit_bias", "logprobs", "top_logprobs", "seed", "stop",
    "chat_template_kwargs", "tools", "role_mapping", "n", "adapters", "draft_model", "num_draft_tokens",
))
STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the second is accepted and has no effect here
IGNORED = frozenset(("user", "tool_choice", "parallel_tool_calls", "response_format", "metadata", "store",
                     "service_tier", "modalities", "suffix", "echo", "best_of"))


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request; ``vocab_size`` and ``context_length`` come from the loaded model."""

    vocab_size: int
    context_length: Optional[int] = None
    max_depth: int = MAX_DEPTH  # nesting of the JSON body, as every JSON input (inputs/json_input.py)
    max_prompt_chars: int = 1 << 20  # all the prompt's text together, before tokenising
    max_messages: int = 512
    max_stop: int = 16
    max_stop_chars: int = 256
    max_logit_bias: int = 1024
    max_tools: int = 128
    max_context_size: int = 1 << 16  # repetition / presence / frequency context sizes
    images: bool = False  # the model reads images (mlxdist serves text models: every image part is refused)
    tool_calls: bool = False  # mlx-lm found a tool parser for the model's chat template: tools may be offered
    allow_request_templates: bool = False  # chat_template_kwargs.chat_template, rendered on rank 0 (templates.py)
    max_template_chars: int = 64 << 10
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # a request's num_draft_tokens (--max-draft-tokens)


def read_object(raw: bytes, max_depth: int) -> Dict[str, Any]:
    """A request body as a JSON object (``json_input``: strict UTF-8,
    nesting at most ``max_depth``, numbers Python can hold); a
    ``RequestError`` (a 400) with the reason."""
    try:
        body = json_input.parse(raw, len(raw), max_depth)
    except ValueError as e:
        raise RequestError(f"the request body {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unreadable = json_input.first_unreadable(body)
    if unreadable is not None:
        raise RequestError(f"the request body holds {unreadable}, which is no number mlxdist reads")
    return body


def check_request(raw: bytes, limits: RequestLimits) -> Tuple[Dict[str, Any], int]:
    """Parse and check one request body: the body and its prompt text's
    characters (counted once, for the prompt limit and the queued-text cap)."""
    body = read_object(raw, limits.max_depth)  # its size: --max-body-bytes, at the socket
    _check_text(body)
    return body, check_fields(body, limits)


def _check_text(body: Dict[str, Any]) -> None:
    """Every string is text: JSON's ``\\ud800`` escapes decode to a lone
    surrogate, which no tokenizer can encode (a 500 deep in the ranks)."""
    for name, value in body.items():
        try:
            json.dumps([name, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"{name[:40]!r} holds a lone surrogate (U+D800 to U+DFFF), which is not text",
                               name[:40]) from None


def check_fields(body: Dict[str, Any], limits: RequestLimits) -> int:
    """Every field of a parsed body, in place (ints where mlx-lm wants floats
    stay numbers); the prompt's characters."""
    unknown = sorted(set(body) - KNOWN - IGNORED)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    _choice(body, "stream", (bool,))
    _check_stream_options(body)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model must be a string (any name: the server serves the model it loaded)", "model")
    for name in ("adapters", "draft_model"):
        if body.get(name) not in (None, "default_model"):
            raise RequestError(f"{name} are not loaded by this server: it serves the one model it started with", name)
    if body.get("n") is not None and (type(body["n"]) is not int or body["n"] != 1):  # true == 1.0 == 1 in Python
        raise RequestError("n must be 1: one choice per request", "n")
    _integer(body, "num_draft_tokens", 0, (1 << 31) - 1)
    if (body.get("num_draft_tokens") or 0) > limits.max_draft_tokens:
        raise RequestError(f"num_draft_tokens must be at most {limits.max_draft_tokens} (this server's "
                           f"--max-draft-tokens), not {body['num_draft_tokens']}", "num_draft_tokens")
    limit = limits.context_length or (1 << 31) - 1
    for name in ("max_tokens", "max_completion_tokens"):
        _integer(body, name, 1, limit)
    _number(body, "temperature", 0, 100)
    _number(body, "top_p", 0, 1)
    _integer(body, "top_k", 0, limits.vocab_size)
    _number(body, "min_p", 0, 1)
    _number(body, "repetition_penalty", 0, 100)
    _number(body, "presence_penalty", -100, 100)
    _number(body, "frequency_penalty", -100, 100)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _integer(body, name, 0, limits.max_context_size)
    _number(body, "xtc_probability", 0, 1, as_float=True)
    _number(body, "xtc_threshold", 0, 0.5, as_float=True)  # mlx-lm's apply_xtc refuses more
    _choice(body, "logprobs", (bool,))
    if body.get("top_logprobs") not in (None, -1):
        _integer(body, "top_logprobs", 0, 10)
    _integer(body, "seed", 0, (1 << 64) - 1)
    _check_logit_bias(body, limits)
    _check_stop(body, limits)
    _check_template_kwargs(body, limits)
    if body.get("role_mapping") is not None:
        mapping = body["role_mapping"]
        if not (isinstance(mapping, dict) and len(mapping) <= 32
                and all(isinstance(k, str) and isinstance(v, str) and len(v) <= 1024 for k, v in mapping.items())):
            raise RequestError("role_mapping must map at most 32 names to strings", "role_mapping")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and len(tools) <= limits.max_tools
                                  and all(isinstance(t, dict) for t in tools)):
        raise RequestError(f"tools must be a list of at most {limits.max_tools} objects", "tools")
    if tools and not limits.tool_calls:
        raise RequestError("tools: this model does not call tools (mlx-lm finds no tool parser for its chat "
                           "template), so a call could not come back as tool_calls", "tools")
    return _check_prompt(body, limits)


def _check_stream_options(body: Dict[str, Any]) -> None:
    """stream_options field by field; mlx-lm reads ``include_usage`` without a
    default, so it is filled in (false) when absent."""
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    for name, value in options.items():
        if name not in STREAM_OPTIONS:
            raise RequestError(f"stream_options.{name[:40]} is not a stream option (known: "
                               f"{', '.join(STREAM_OPTIONS)})", "stream_options")
        if not isinstance(value, bool):
            raise RequestError(f"stream_options.{name} must be true or false", "stream_options")
    body["stream_options"] = {"include_usage": options.get("include_usage", False)}  # what mlx-lm reads


def _choice(body: Dict[str, Any], name: str, types: tuple) -> None:
    if name in body and body[name] is not None and not isinstance(body[name], types):
        raise RequestError(f"{name} must be a {' or '.join(t.__name__ for t in types)}", name)


def _integer(body: Dict[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], not {value}", name)


def _number(body: Dict[str, Any], name: str, low: float, high: float, as_float: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be in [{low}, {high}], not {value}", name)
    if as_float:  # mlx-lm's own check wants a float here
        body[name] = float(value)


def _check_logit_bias(body: Dict[str, Any], limits: RequestLimits) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > limits.max_logit_bias:
        raise RequestError(f"logit_bias must be an object of at most {limits.max_logit_bias} token ids",
                           "logit_bias")
    for token, value in bias.items():
        try:
            token_id = parse_int(token, "a logit_bias key", max_digits=12)
        except ValueError as e:
            raise RequestError(f"logit_bias: {e}", "logit_bias") from None
        if token_id >= limits.vocab_size:
            raise RequestError(f"logit_bias: {token[:40]!r} is not a token id of this model's vocabulary "
                               f"(0 to {limits.vocab_size - 1})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias: the bias of token {token} must be a number in [-100, 100]",
                               "logit_bias")


def _check_stop(body: Dict[str, Any], limits: RequestLimits) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    words = [stop] if isinstance(stop, str) else stop
    if not (isinstance(words, list) and len(words) <= limits.max_stop
            and all(isinstance(w, str) and 0 < len(w) <= limits.max_stop_chars for w in words)):
        raise RequestError(f"stop must be a string or a list of at most {limits.max_stop} non-empty strings "
                           f"of at most {limits.max_stop_chars} characters", "stop")


def _check_template_kwargs(body: Dict[str, Any], limits: RequestLimits) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or len(kwargs) > 32:
        raise RequestError("chat_template_kwargs must be an object of at most 32 variables", "chat_template_kwargs")
    for key, value in kwargs.items():
        if key == "chat_template" and limits.allow_request_templates:
            if not (isinstance(value, str) and 0 < len(value) <= limits.max_template_chars):
                raise RequestError(f"chat_template_kwargs.chat_template must be a template of at most "
                                   f"{limits.max_template_chars} characters", "chat_template_kwargs")
            if "messages" not in body:
                raise RequestError("a chat template needs messages", "chat_template_kwargs")
            continue
        if key in TEMPLATE_PARAMETERS:
            raise RequestError(f"chat_template_kwargs may not set {key!r}: a request cannot change how the "
                               f"template is rendered (see docs/SECURITY.md)", "chat_template_kwargs")
        if not (value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 1024)):
            raise RequestError(f"chat_template_kwargs.{key} must be a boolean, a number, null or a short string",
                               "chat_template_kwargs")


def _check_prompt(body: Dict[str, Any], limits: RequestLimits) -> int:
    """The prompt's characters, checked against the limit."""
    if "messages" in body and "prompt" in body:
        raise RequestError("give messages or prompt, not both", "messages")
    if "messages" in body:
        return _check_messages(body["messages"], limits)
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string", "prompt")
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")
        if len(prompt) > limits.max_prompt_chars:
            raise RequestError(f"prompt of {len(prompt)} characters exceeds the limit of {limits.max_prompt_chars}",
                               "prompt")
        return len(prompt)
    return 0


def _check_messages(messages: Any, limits: RequestLimits) -> int:
    if not isinstance(messages, list) or not 1 <= len(messages) <= limits.max_messages:
        raise RequestError(f"messages must be a list of 1 to {limits.max_messages} messages", "messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object", "messages")
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            chars += len(content or "")
        elif isinstance(content, list):
            chars += sum(_part_chars(part, i, limits) for part in content)
        else:
            raise RequestError(f"messages[{i}].content must be a string or a list of parts", "messages")
        for name, value in message.items():
            if name not in ("role", "content") and value is not None and not isinstance(value, (str, list, dict)):
                raise RequestError(f"messages[{i}].{name} has an unexpected type", "messages")
        calls = message.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, i)
    if chars > limits.max_prompt_chars:
        raise RequestError(f"messages of {chars} characters exceed the limit of {limits.max_prompt_chars}",
                           "messages")
    return chars


def _part_chars(part: Any, i: int, limits: RequestLimits) -> int:
    if not isinstance(part, dict):
        raise RequestError(f"messages[{i}].content parts must be objects", "messages")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"messages[{i}]: a text part needs a string 'text'", "messages")
        return len(part["text"])
    if kind in ("image_url", "input_image", "image"):
        url = part.get("image_url", part.get("image"))
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RequestError(f"messages[{i}]: an image part needs a URL", "messages")
        if not limits.images:
            raise RequestError(f"messages[{i}]: this server's model reads text only: no image parts "
                               f"(of any URL: http, data or file)", "messages")
        if not url.startswith("data:"):
            raise RequestError(f"messages[{i}]: an image is sent as a data: URL (no fetching of other URLs)",
                               "messages")
        return 0
    raise RequestError(f"messages[{i}]: content parts must be of type text"
                       f"{' or image_url' if limits.images else ''}, not {str(kind)[:40]!r}", "messages")


def _check_tool_calls(calls: Iterable[Any], i: int) -> None:
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be a list", "messages")
    for call in calls:
        if not isinstance(call, dict):  # mlx-lm reads each with .get
            raise RequestError(f"messages[{i}].tool_calls: each call must be an object", "messages")
        function = call.get("function")
        if function is not None and not isinstance(function, dict):
            raise RequestError(f"messages[{i}].tool_calls: function must be an object", "messages")
        if not isinstance((function or {}).get("name", ""), str):  # templates join it to text
            raise RequestError(f"messages[{i}].tool_calls: function.name must be a string", "messages")
        arguments = (function or {}).get("arguments")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except (ValueError, RecursionError):
                raise RequestError(f"messages[{i}].tool_calls: arguments must be JSON", "messages") from None


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Any] = None) -> Dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
