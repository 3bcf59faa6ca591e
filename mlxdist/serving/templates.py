"""A request's own chat template, rendered on rank 0 alone (``serve
--allow-request-templates``): in a child process (``render_child.py``) under
jinja2's ``ImmutableSandboxedEnvironment``, bounded in time (killed past
``RENDER_SECONDS``), memory (an address-space rlimit) and output (the
prompt-length limit), and at most ``RENDERS_AT_ONCE`` at a time. The other
ranks receive the rendered text, never the template, so no rank can disagree
about its outcome; a bound exceeded is the request's 400.

    render(template, variables, max_chars) -> the prompt text, or RequestError
"""

import copy
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Optional

from mlxdist import compat
from mlxdist.errors import RequestError

RENDER_SECONDS = 2.0  # wall-clock bound of one render
RENDER_MEMORY = 512 << 20  # bytes of address space the child may map
RENDERS_AT_ONCE = 2
MAX_TEMPLATE_CHARS = 64 << 10
_CHILD = Path(__file__).with_name("render_child.py")
_RENDERS = threading.BoundedSemaphore(RENDERS_AT_ONCE)
_PARAM = "chat_template_kwargs"


def render(template: str, variables: Dict[str, Any], max_chars: int, seconds: float = RENDER_SECONDS) -> str:
    """Render ``template`` with ``variables`` (messages, tools, the request's
    other template variables, the tokenizer's special tokens), at most
    ``max_chars`` characters, within ``seconds``."""
    if not _RENDERS.acquire(timeout=seconds):
        raise RequestError(f"{RENDERS_AT_ONCE} request templates are rendering already: try again later", _PARAM, 429)
    try:
        job = json.dumps({"template": template, "variables": variables, "max_chars": max_chars,
                          "memory": RENDER_MEMORY, "cpu_seconds": int(seconds) + 1}).encode()
        try:
            done = subprocess.run([sys.executable, "-I", str(_CHILD)], input=job, capture_output=True, timeout=seconds)
        except subprocess.TimeoutExpired:  # run() killed the child
            raise RequestError(f"the request's chat template did not finish rendering within {seconds:g} s",
                               _PARAM) from None
    finally:
        _RENDERS.release()
    try:
        result = json.loads(done.stdout)
    except ValueError:
        result = {"error": f"the renderer stopped (status {done.returncode}): past its memory or CPU bound?"}
    if "error" in result:
        raise RequestError(f"the request's chat template failed: {result['error']}"[:500], _PARAM)
    return result["text"]


def render_request_template(tokenizer: Any, body: Dict[str, Any], max_chars: int) -> Optional[str]:
    """The prompt text of a chat request that brings its own template
    (``chat_template_kwargs.chat_template``, only past the schema under
    ``--allow-request-templates``), rendered with its messages, tools,
    other template variables and ``tokenizer``'s special tokens; None for
    a request without one. The template is taken out of ``body``."""
    kwargs = body.get("chat_template_kwargs") or {}
    if "chat_template" not in kwargs:
        return None
    template = kwargs.pop("chat_template")
    messages = copy.deepcopy(body["messages"])
    try:
        compat.process_message_content(messages)
    except (ValueError, KeyError, TypeError) as e:
        raise RequestError(f"messages: {e}", "messages") from None
    special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    variables = {**special, **kwargs, "messages": messages, "tools": body.get("tools"), "add_generation_prompt": True}
    text = render(template, variables, max_chars)
    if not text:
        raise RequestError("the request's chat template renders no text", _PARAM)
    return text
