"""``POST /tokenize`` on the rank server: how many tokens a chat request's
prompt (its messages, tools and template variables, through the chat
template the server uses) or a plain ``prompt`` text is, counted by rank 0
with the tokenizer and template the ranks will use, and nothing generated.
The front answers Anthropic's ``/v1/messages/count_tokens`` with it.

    {"messages": [...], "tools": [...]} or {"prompt": "text"}  ->  {"count": n, "max_model_len": context or null}
"""

import copy
import types
from typing import Any, Dict

from mlxdist import compat
from mlxdist.errors import RequestError, one_line

TOKENIZE_PATH = "/tokenize"


def count_tokens(generator: Any, body: Dict[str, Any]) -> Dict[str, Any]:
    """The answer to a ``/tokenize`` body already checked by the request
    schema: ``generator`` is the server's response generator (its model
    provider holds the tokenizer once the model is loaded)."""
    tokenizer = generator.model_provider.tokenizer
    if tokenizer is None:
        raise RequestError("the model is still loading", None, 503)
    if "chat_template" in (body.get("chat_template_kwargs") or {}):  # rendered only in templates.py's sandbox
        raise RequestError("a request's own chat template is not counted here", "chat_template_kwargs")
    if "messages" in body:
        request = compat.CompletionRequest("chat", "", copy.deepcopy(body["messages"]), body.get("tools") or None,
                                           body.get("role_mapping"))
    elif "prompt" in body:  # the text alone, as a rendered chat is encoded: no special tokens added
        return {"count": len(tokenizer.encode(body["prompt"], add_special_tokens=False)),
                "max_model_len": generator.model_provider.engine.context_length}
    else:
        raise RequestError("give messages or prompt", "messages")
    args = types.SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    try:
        prompt = compat.ResponseGenerator._tokenize(generator, tokenizer, request, args)[0]
    except Exception as e:  # noqa: BLE001 - the template's or tokenizer's refusal of these messages
        raise RequestError(f"the chat template cannot render these messages: {one_line(e)}", "messages") from None
    return {"count": len(prompt), "max_model_len": generator.model_provider.engine.context_length}
