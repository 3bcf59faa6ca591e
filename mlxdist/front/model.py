"""What the front knows of the served model: the tokenizer (with the chat
template the ranks use), the request schema's limits and the server's
defaults, read from the rank server's ``GET /mlxdist/model`` once the job
serves and kept while the model stays the same (a job restarted on the
ranks left serves the same folder).

    model = await models.current()   # ServedModel; Unavailable while the job does not serve
"""

import asyncio
import json
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from mlxdist import envs
from mlxdist.errors import GenerationFailed, one_line
from mlxdist.front.errors import Unavailable
from mlxdist.serving.arguments import Defaults
from mlxdist.serving.schema import RequestLimits

MODEL_PATH = "/mlxdist/model"  # the rank server's facts of its model (serving/http.py)


@dataclass(frozen=True)
class ServedModel:
    """The tokenizer (mlx-lm's ``TokenizerWrapper``), the schema's limits,
    and the defaults a request's missing fields take (``defaults.model``:
    the name every answer carries)."""

    tokenizer: Any
    limits: RequestLimits  # context_length among them
    defaults: Defaults


def load_served_model(facts: Dict[str, Any]) -> ServedModel:
    """The served model from the rank server's facts: its folder's tokenizer
    loaded here, the chat template it serves with set on it."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(facts["path"], {"trust_remote_code": envs.get("MLXDIST_TRUST_REMOTE_CODE")})
    if facts.get("chat_template"):
        tokenizer.chat_template = facts["chat_template"]
    known = {f.name for f in fields(RequestLimits)}
    limits = RequestLimits(**{k: v for k, v in facts["limits"].items() if k in known})
    return ServedModel(tokenizer, limits, Defaults(**facts["defaults"]))


class ModelFacts:
    """The ``ServedModel`` of the job ``upstream`` serves from, loaded on
    the first request and again only when the rank server's facts change."""

    def __init__(self, upstream: Any):
        self.upstream = upstream
        self._key: Optional[str] = None  # the facts the model was loaded from
        self._model: Optional[ServedModel] = None
        self._base: Optional[str] = None  # the job whose facts were read last
        self._lock = asyncio.Lock()

    async def current(self, arrived: Optional[str] = None) -> ServedModel:
        """The served model; for a request that came while the job at
        ``arrived`` served, that job's, even where it has stopped serving."""
        base = getattr(self.upstream.job, "base_url", None)
        if self._model is not None and self._base is not None and self._base in (base, arrived):
            return self._model
        answer = await self.upstream.get(MODEL_PATH)
        if answer.status_code != 200:
            raise Unavailable(f"the rank server did not say what it serves ({answer.status_code})",
                              self.upstream.retry_after)
        facts = json.loads(answer.content)
        key = json.dumps(facts, sort_keys=True)
        async with self._lock:
            if key != self._key:
                try:
                    self._model = await asyncio.to_thread(load_served_model, facts)
                except Exception as e:  # noqa: BLE001 - the request fails with the reason; the next one tries again
                    raise GenerationFailed(f"the front cannot load the served tokenizer: {one_line(e)}") from None
                self._key = key
            self._base = base
            return self._model
