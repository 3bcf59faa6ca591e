"""What the front answers when the rank job cannot: ``Unavailable`` (a 503
with ``Retry-After``), and the OpenAI-shaped bodies of its refusals."""

from typing import Any, Dict, Optional

from mlxdist.errors import MlxdistError
from mlxdist.serving.schema import error_body

DEFAULT_RETRY_AFTER = 5


class Unavailable(MlxdistError, RuntimeError):
    """The rank job is not serving (starting, recovering, stopped) or was lost
    mid-answer: HTTP 503, try again after ``retry_after`` seconds."""

    status = 503

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER):
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))

    def body(self) -> Dict[str, Any]:
        """The OpenAI-shaped error body."""
        return error_body(str(self), "server_error", None, 503)


def refusal(message: str, status: int, param: Optional[str] = None) -> Dict[str, Any]:
    """An OpenAI-shaped error body for a refusal with HTTP ``status``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return error_body(message, kind, param, status)
