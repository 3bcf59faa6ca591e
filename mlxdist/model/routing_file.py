"""The routing statistics file: how many routed slots each expert of each
MoE layer received over a job (``--record-routing FILE``), the input of
``python -m mlxdist.place``. The format::

    {
      "version": 1,
      "kind": "mlxdist-routing",
      "model": {"model_type": "qwen3_moe", "config": "<digest of config.json>",
                "num_experts": {"0": 12, "1": 12}, "top_k": 4},
      "tokens": 1234,
      "layers": {"0": [counts per expert], "1": [...]}
    }

``layers[L][e]`` counts the (token, k) slots the router of layer ``L``
sent to expert ``e`` (global ids: what the router chose, whichever rank
computed it). ``tokens`` is the tokens routed per layer (the first layer's
slots over ``top_k``; null where top-k is not known).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from mlxdist.inputs import json_input
from mlxdist.inputs.digits import is_digits
from mlxdist.errors import UserError
from mlxdist.values.placement import MAX_EXPERTS, write_json_atomic

ROUTING_VERSION = 1
KIND = "mlxdist-routing"
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k_experts", "moe_k",
               "experts_per_token", "num_selected_experts")


@dataclass(frozen=True)
class RoutingStats:
    layers: Dict[int, List[int]]  # layer -> [E] routed slots per expert
    top_k: Optional[int] = None
    model_type: Optional[str] = None
    config_digest: Optional[str] = None

    @property
    def tokens(self) -> Optional[int]:
        if not self.top_k or not self.layers:
            return None
        return sum(self.layers[min(self.layers)]) // self.top_k

    @classmethod
    def for_model(cls, counts: Dict[int, List[int]], config: Dict[str, Any], config_digest: Optional[str],
                  num_experts: Dict[int, int]) -> "RoutingStats":
        """Counts of a loaded model (layers it never routed: zeros)."""
        layers = {l: list(map(int, counts.get(l, [0] * e))) for l, e in sorted(num_experts.items())}
        return cls(layers, model_top_k(config), config.get("model_type"), config_digest)

    def to_json(self) -> dict:
        return {
            "version": ROUTING_VERSION,
            "kind": KIND,
            "model": {"model_type": self.model_type, "config": self.config_digest,
                      "num_experts": {str(l): len(c) for l, c in sorted(self.layers.items())}, "top_k": self.top_k},
            "tokens": self.tokens,
            "layers": {str(l): c for l, c in sorted(self.layers.items())},
        }

    @classmethod
    def from_json(cls, obj: Any) -> "RoutingStats":
        if not isinstance(obj, dict) or obj.get("kind") != KIND:
            raise UserError("not a routing statistics file (written by --record-routing)")
        if obj.get("version") != ROUTING_VERSION or type(obj.get("version")) is not int:
            raise UserError(f"routing file version {obj.get('version')!r} is not {ROUTING_VERSION}")
        model, layers = obj.get("model"), obj.get("layers")
        if not isinstance(model, dict) or not isinstance(layers, dict) or not layers:
            raise UserError("routing file is malformed: it needs a model object and per-layer counts")
        parsed = {}
        for key, counts in layers.items():
            if not is_digits(key, 9):
                raise UserError(f"routing file is malformed: layer key {key!r:.40} is not a layer index")
            if (not isinstance(counts, list) or not 1 <= len(counts) <= MAX_EXPERTS
                    or any(type(c) is not int or c < 0 for c in counts)):
                raise UserError(f"routing file is malformed: layer {key} must list a count >= 0 per expert")
            parsed[int(key)] = counts
        top_k = model.get("top_k")
        if top_k is not None and (type(top_k) is not int or top_k < 1):
            raise UserError(f"routing file is malformed: top_k {top_k!r:.40}")
        model_type, digest = model.get("model_type"), model.get("config")
        return cls(parsed, top_k, model_type if isinstance(model_type, str) else None,
                   digest if isinstance(digest, str) else None)

    def save(self, path: Union[str, Path]) -> None:
        """Written atomically: a reader never sees half a file."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "RoutingStats":
        return cls.from_json(json_input.read_file(path, "routing", UserError))


def model_top_k(config: Dict[str, Any]) -> Optional[int]:
    """Experts per token from a config.json, where it names them."""
    for cfg in (config.get("text_config") or {}, config, config.get("ffn_config") or {}):
        for key in _TOP_K_KEYS:
            value = cfg.get(key) if isinstance(cfg, dict) else None
            if type(value) is int and value > 0:
                return value
    return None
