"""The token channel: the rank server's ``POST /mlxdist/tokens``, by which
the front (``front/completions.py``) has rank 0 generate from token ids it
tokenised itself, and reads token ids back to detokenise itself. The
request joins the same lockstep batch as any other (``lockstep.py``).

    {"prompt_token_ids": [ids], "segments": [[ids], ...], "segment_types": ["system"|"user"|"assistant", ...],
     "initial_state": "normal", "chars": n, <sampling fields: arguments.SAMPLING_FIELDS>}
      -> text/event-stream:
    data: {"token": id, "logprob": lp, "finish_reason": null|"stop"|"length", "top": [[id, lp], ...],
           "prompt_tokens": n, "cached_tokens": n}      (the last two on the first line only)
    : keepalive done/total                              (prompt progress, between tokens)
    data: [DONE]                                        (or an error event: data: {"error": {...}})

``segments`` split the prompt where mlx-lm's prompt cache keeps its parts
(a system prompt, the conversation, a thinking tail); ``chars`` is the
prompt's text length, counted in the rank server's queued-text cap as a
text request's is. Every field is checked as a request's are: a token id
outside the vocabulary, segments that are not the prompt, or a sampling
field the schema refuses is a 400.
"""

import json
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from mlxdist import compat
from mlxdist.errors import GenerationFailed, RankLost, RequestError
from mlxdist.serving.arguments import SAMPLING_FIELDS, Defaults, generation_arguments
from mlxdist.serving.schema import RequestLimits, check_fields, error_body, read_object

TOKENS_PATH = "/mlxdist/tokens"
SEGMENT_TYPES = ("system", "user", "assistant")
_MAX_STATE_CHARS = 64


@dataclass
class TokenRequest(compat.CompletionRequest):
    """mlx-lm's ``CompletionRequest`` of ``request_type`` ``"tokens"``: its
    ``prompt`` is token ids, already split into ``segments``
    (``segment_types``), with the answer's ``initial_state`` (``normal``, or
    ``reasoning`` after a thinking tag); ``chars``: the prompt's text."""

    segments: List[List[int]]
    segment_types: List[str]
    initial_state: str
    chars: int


def token_body(tokenized: Tuple[List[int], List[List[int]], List[str], str, Any], chars: int,
               body: Dict[str, Any]) -> Dict[str, Any]:
    """The channel's request: mlx-lm's ``_tokenize`` result (prompt,
    segments, their types, initial state, vision), the prompt's characters,
    and the sampling fields of the client's checked ``body``."""
    prompt, segments, segment_types, initial_state, _ = tokenized
    return {"prompt_token_ids": list(prompt), "segments": [list(s) for s in segments],
            "segment_types": list(segment_types), "initial_state": initial_state, "chars": chars,
            **{k: body[k] for k in SAMPLING_FIELDS if k in body}}


def read_token_request(raw: bytes, limits: RequestLimits, defaults: Defaults) -> Tuple[TokenRequest, Any, int]:
    """The channel's request, checked: (the request, mlx-lm's generation
    arguments, the prompt's characters); ``RequestError`` names the field."""
    body = read_object(raw, limits.max_depth)
    fields = ("prompt_token_ids", "segments", "segment_types", "initial_state", "chars")
    prompt, segments, segment_types, initial_state, chars = (body.pop(k, None) for k in fields)
    unknown = sorted(set(body) - set(SAMPLING_FIELDS))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", unknown[0])
    most = limits.context_length or (1 << 31) - 1
    if not (isinstance(prompt, list) and 0 < len(prompt) <= most
            and all(type(t) is int and 0 <= t < limits.vocab_size for t in prompt)):
        raise RequestError(f"prompt_token_ids must be 1 to {most} token ids below {limits.vocab_size}",
                           "prompt_token_ids")
    if not (isinstance(segments, list) and segments and all(isinstance(s, list) and s for s in segments)
            and [t for s in segments for t in s] == prompt):
        raise RequestError("segments must split prompt_token_ids into non-empty parts", "segments")
    if not (isinstance(segment_types, list) and len(segment_types) == len(segments)
            and all(t in SEGMENT_TYPES for t in segment_types)):
        raise RequestError(f"segment_types must give each segment one of {', '.join(SEGMENT_TYPES)}",
                           "segment_types")
    if not (isinstance(initial_state, str) and 0 < len(initial_state) <= _MAX_STATE_CHARS):
        raise RequestError("initial_state must be a state's name", "initial_state")
    if not (type(chars) is int and 0 <= chars <= limits.max_prompt_chars):
        raise RequestError(f"chars must be 0 to {limits.max_prompt_chars}", "chars")
    check_fields(body, limits)
    request = TokenRequest("tokens", prompt, [], None, None, segments, segment_types, initial_state, chars)
    return request, generation_arguments(body, defaults), chars


def tokenized(request: TokenRequest) -> Tuple[List[int], List[List[int]], List[str], str, None]:
    """mlx-lm's ``_tokenize`` result of a token request (copies: mlx-lm's loop pops its segments)."""
    return (list(request.prompt), [list(s) for s in request.segments], list(request.segment_types),
            request.initial_state, None)


def stream_tokens(handler: Any, request: TokenRequest, args: Any) -> None:
    """Generate ``request`` in the server's batch and write its tokens to
    ``handler``'s client as the channel's events (module docstring)."""
    generator = handler.response_generator

    def write(line: str) -> None:
        handler.wfile.write(line.encode())
        handler.wfile.flush()

    try:
        ctx, responses = generator.generate(request, args, progress_callback=lambda done, total: write(
            f": keepalive {done}/{total}\n\n"))
    except Exception as e:  # noqa: BLE001 - this request's refusal or failure, in OpenAI's shape
        status = _status(e, generator)
        handler._refuse(status, str(e), "invalid_request_error" if status < 500 else "server_error",
                        getattr(e, "param", None))
        return
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    handler.end_headers()
    first = True
    try:
        for gen in responses:
            event: Dict[str, Any] = {"token": gen.token, "logprob": gen.logprob, "finish_reason": gen.finish_reason}
            if gen.top_tokens:
                event["top"] = [[t["id"], t["logprob"]] for t in gen.top_tokens]
            if first:
                event.update(prompt_tokens=len(ctx.prompt), cached_tokens=ctx.prompt_cache_count)
                first = False
            write(f"data: {json.dumps(event)}\n\n")
        write("data: [DONE]\n\n")
    except (RankLost, GenerationFailed) as e:  # mid-answer: an error event ends the stream
        status = 503 if isinstance(e, RankLost) else 500
        try:
            write(f"data: {json.dumps(error_body(str(e), 'server_error', None, status))}\n\n")
        except OSError:
            pass
    except OSError:  # the front left: its request leaves the batch (ctx.stop below)
        logging.info("the front left a token stream")
        handler.close_connection = True
    finally:
        ctx.stop()


def _status(e: BaseException, generator: Any) -> int:
    if isinstance(e, RequestError):
        return e.status
    if isinstance(e, RankLost) or (isinstance(e, RuntimeError) and not generator.generation_available()):
        return 503
    return 500
