"""A request's prompt as token ids, with mlx-lm's tokenisation (its chat
template, its segments for the prompt cache), wherever it runs: in the
front (``front/completions.py``), on the ranks for a request sent as text
(``lockstep.py``), and for ``POST /tokenize``: how many tokens a chat
request's prompt (messages, tools, template variables) or a plain
``prompt`` text is, nothing generated (Anthropic's
``/v1/messages/count_tokens`` in the front).

    prompt, segments, segment_types, initial_state, _ = tokenize_request(tokenizer, request, args)
    {"messages": [...], "tools": [...]} or {"prompt": "text"}  ->  {"count": n, "max_model_len": context or null}
"""

import contextlib
import copy
import types
from typing import Any, Dict, Iterator, List, Optional, Tuple

from jinja2 import TemplateError

from mlxdist import compat
from mlxdist.errors import GenerationFailed, RequestError, one_line

TOKENIZE_PATH = "/tokenize"
Tokenized = Tuple[List[int], List[List[int]], List[str], str, Any]  # mlx-lm's _tokenize result


@contextlib.contextmanager
def tokenizing_errors() -> Iterator[None]:
    """A tokenisation's failure as the request's: a template that cannot
    render its messages is a 400, anything else a 500."""
    try:
        yield
    except (RequestError, GenerationFailed):
        raise
    except TemplateError as e:
        raise RequestError(f"the chat template cannot render these messages: {one_line(e)}", "messages") from None
    except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
        raise GenerationFailed(f"cannot tokenise this request: {one_line(e)}") from None


def _template_only(chat_template_args: Optional[Dict[str, Any]] = None) -> Any:
    """What mlx-lm's ``ResponseGenerator._tokenize`` reads of its generator
    for a text model: no image processor, the server's template arguments."""
    return types.SimpleNamespace(model_provider=types.SimpleNamespace(
        processor=None, cli_args=types.SimpleNamespace(chat_template_args=chat_template_args or {})))


def tokenize_request(tokenizer: Any, request: Any, args: Any, rendered: Optional[str] = None) -> Tokenized:
    """mlx-lm's tokenisation of ``request`` (a ``CompletionRequest``) with
    ``args``' template variables, or of ``rendered``, the text of the
    request's own chat template; failures as ``tokenizing_errors`` says."""
    with tokenizing_errors():
        if rendered is not None:
            return rendered_tokens(tokenizer, rendered)
        return compat.ResponseGenerator._tokenize(_template_only(), tokenizer, request, args)


def check_context(prompt_tokens: int, max_tokens: int, context_length: Optional[int]) -> None:
    """A prompt of ``prompt_tokens`` with room for ``max_tokens`` more within the model's context, or a 400."""
    if context_length is not None and prompt_tokens + max_tokens > context_length:
        raise RequestError(f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} "
                           f"exceeds the model's context of {context_length}")


def rendered_tokens(tokenizer: Any, text: str) -> Tokenized:
    """mlx-lm's ``_tokenize`` result for a chat prompt already rendered to
    ``text`` (as apply_chat_template encodes it: no special tokens added)."""
    prompt = tokenizer.encode(text, add_special_tokens=False)
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return prompt, [prompt], ["assistant"], tokenizer.response_initial_state or state, None


def count_tokens(tokenizer: Any, body: Dict[str, Any], context_length: Optional[int]) -> Dict[str, Any]:
    """The answer to a ``/tokenize`` body already checked by the request
    schema, counted with ``tokenizer`` (None: the model is still loading)."""
    if tokenizer is None:
        raise RequestError("the model is still loading", None, 503)
    if "chat_template" in (body.get("chat_template_kwargs") or {}):  # rendered only in templates.py's sandbox
        raise RequestError("a request's own chat template is not counted here", "chat_template_kwargs")
    if "messages" in body:
        request = compat.CompletionRequest("chat", "", copy.deepcopy(body["messages"]), body.get("tools") or None,
                                           body.get("role_mapping"))
    elif "prompt" in body:  # the text alone, as a rendered chat is encoded: no special tokens added
        return {"count": len(tokenizer.encode(body["prompt"], add_special_tokens=False)),
                "max_model_len": context_length}
    else:
        raise RequestError("give messages or prompt", "messages")
    args = types.SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    try:
        prompt = compat.ResponseGenerator._tokenize(_template_only(), tokenizer, request, args)[0]
    except Exception as e:  # noqa: BLE001 - the template's or tokenizer's refusal of these messages
        raise RequestError(f"the chat template cannot render these messages: {one_line(e)}", "messages") from None
    return {"count": len(prompt), "max_model_len": context_length}
