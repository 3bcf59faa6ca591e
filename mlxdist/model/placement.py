"""Which rank owns which expert of which MoE layer.

A placement is a value: built by a policy, validated against a model and a
world size, saved to and loaded from JSON. The file format::

    {
      "version": 1,
      "num_ranks": 4,
      "layers": {"0": [0, 0, 1, 1, 2, 2, 3, 3], "1": [...]}
    }

``layers`` maps each MoE layer's index in the model (the ``N`` of
``model.layers.N``) to a list with one owner rank per expert. Each expert has
exactly one owner.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

from mlxdist.errors import PlacementError

PLACEMENT_VERSION = 1


@dataclass(frozen=True)
class Placement:
    num_ranks: int
    layers: Dict[int, List[int]]

    @classmethod
    def even(
        cls,
        experts_per_layer: Dict[int, int],
        num_ranks: int,
        rank0_experts: bool = True,
    ) -> "Placement":
        """Spread each layer's experts in contiguous, even blocks over the
        ranks (over ranks 1..N-1 when ``rank0_experts`` is False)."""
        owners = list(range(num_ranks))
        if not rank0_experts and num_ranks > 1:
            owners = owners[1:]
        layers = {}
        n = len(owners)
        for layer, num_experts in experts_per_layer.items():
            if num_experts < n:
                raise PlacementError(
                    f"{n} ranks hold experts but layer {layer} has only "
                    f"{num_experts}: a rank would sit idle; use fewer ranks"
                )
            layers[layer] = [owners[e * n // num_experts] for e in range(num_experts)]
        return cls(num_ranks, layers)

    def experts_of(self, layer: int, rank: int) -> List[int]:
        """The global ids of the experts ``rank`` owns in ``layer``."""
        return [e for e, r in enumerate(self.layers[layer]) if r == rank]

    def validate(self, experts_per_layer: Dict[int, int], num_ranks: int) -> None:
        """Raise ``PlacementError`` unless this placement fits the model and
        the world: the same MoE layers, every expert owned by a rank that
        exists, and no rank left idle where the layer has experts to spare."""
        if self.num_ranks != num_ranks:
            raise PlacementError(
                f"placement is for {self.num_ranks} ranks, the job has {num_ranks}"
            )
        if set(self.layers) != set(experts_per_layer):
            missing = sorted(set(experts_per_layer) - set(self.layers))
            extra = sorted(set(self.layers) - set(experts_per_layer))
            raise PlacementError(
                f"placement layers do not match the model's MoE layers "
                f"(missing {missing}, not MoE in the model {extra})"
            )
        for layer, owners in sorted(self.layers.items()):
            num_experts = experts_per_layer[layer]
            if len(owners) != num_experts:
                raise PlacementError(
                    f"layer {layer}: placement lists {len(owners)} experts, "
                    f"the model has {num_experts}"
                )
            bad = [r for r in owners if not isinstance(r, int) or not 0 <= r < num_ranks]
            if bad:
                raise PlacementError(
                    f"layer {layer}: owner rank {bad[0]!r} does not exist "
                    f"(ranks are 0..{num_ranks - 1})"
                )
        # Rank 0 may hold no experts (it still runs the dense part); any
        # other rank without one would only add latency.
        idle = [
            r
            for r in range(1, num_ranks)
            if all(r not in owners for owners in self.layers.values())
        ]
        if idle:
            raise PlacementError(
                f"rank(s) {idle} own no expert in any layer; use fewer ranks "
                f"(the model has {min(experts_per_layer.values())} experts per layer)"
            )

    def to_json(self) -> dict:
        return {
            "version": PLACEMENT_VERSION,
            "num_ranks": self.num_ranks,
            "layers": {str(l): owners for l, owners in sorted(self.layers.items())},
        }

    @classmethod
    def from_json(cls, obj: dict) -> "Placement":
        if not isinstance(obj, dict):
            raise PlacementError("placement must be a JSON object")
        if obj.get("version") != PLACEMENT_VERSION:
            raise PlacementError(
                f"placement version {obj.get('version')!r} is not {PLACEMENT_VERSION}"
            )
        try:
            num_ranks = int(obj["num_ranks"])
            layers = {int(k): list(v) for k, v in obj["layers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlacementError(f"placement is malformed: {e!r}") from None
        return cls(num_ranks, layers)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Placement":
        try:
            obj = json.loads(Path(path).read_text())
        except OSError as e:
            raise PlacementError(f"cannot read placement file {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise PlacementError(f"placement file {path} is not JSON: {e}") from None
        return cls.from_json(obj)


def resolve_placement(
    placement: Optional[dict],
    experts_per_layer: Dict[int, int],
    num_ranks: int,
    rank0_experts: bool = True,
) -> Placement:
    """The placement a job uses: the given JSON object, or the even policy."""
    if placement is None:
        result = Placement.even(experts_per_layer, num_ranks, rank0_experts)
    else:
        result = Placement.from_json(placement)
    result.validate(experts_per_layer, num_ranks)
    return result
