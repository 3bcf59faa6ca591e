"""What the front answers when the rank job cannot: ``Unavailable`` (a 503
with ``Retry-After``), and the OpenAI-shaped bodies of its refusals."""

from typing import Any, Dict, Optional

from mlxdist.errors import Unavailable
from mlxdist.serving.schema import error_body

DEFAULT_RETRY_AFTER = 5

__all__ = ["DEFAULT_RETRY_AFTER", "Unavailable", "refusal", "unavailable_body"]


def unavailable_body(e: Unavailable) -> Dict[str, Any]:
    """The OpenAI-shaped body of a 503 for ``e``."""
    return error_body(str(e), "server_error", None, 503)


def refusal(message: str, status: int, param: Optional[str] = None) -> Dict[str, Any]:
    """An OpenAI-shaped error body for a refusal with HTTP ``status``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return error_body(message, kind, param, status)
