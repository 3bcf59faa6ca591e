"""Which ranks hold which expert of which MoE layer.

A placement is a value: built by a policy (``even`` here; the load-balanced
one in ``balance.py``), validated against a model and a world size, saved
to and loaded from JSON. In memory, ``layers[L][e]`` is the tuple of ranks
holding expert ``e`` of layer ``L``: the first is its primary, any others
hold duplicates (``dispatch/ownership.py`` splits the expert's slots among
them). The file format::

    {
      "version": 2,
      "num_ranks": 4,
      "layers": {"0": [0, [0, 2], 1, 1, 2, 3, 3, 3], "1": [...]}
    }

``layers`` maps each MoE layer's index in the model (the ``N`` of
``model.layers.N``) to one entry per expert: an owner rank, or a list of
distinct ranks (duplicates, the primary first). A placement without duplicates
is written as version 1, whose entries are all plain ranks; both versions
are read.
"""

import json
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from mlxdist.inputs import json_input
from mlxdist.inputs.digits import is_digits
from mlxdist.errors import PlacementError

PLACEMENT_VERSION = 2  # the newest version written (1: one owner per expert)
MAX_RANKS = 1 << 16
MAX_EXPERTS = 1 << 20  # per layer

Owners = Tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    num_ranks: int
    layers: Dict[int, List[Owners]]  # layer -> [E] holders of each expert, the primary first

    @classmethod
    def even(
        cls,
        experts_per_layer: Dict[int, int],
        num_ranks: int,
        rank0_experts: bool = True,
        budgets: Optional[Sequence[float]] = None,
    ) -> "Placement":
        """Spread each layer's experts in contiguous blocks over the ranks
        (over ranks 1..N-1 when ``rank0_experts`` is False): even blocks, or,
        with ``budgets`` (one per rank, any unit), blocks in proportion to
        them, each rank holding at least one expert."""
        owners = list(range(num_ranks))
        if not rank0_experts and num_ranks > 1:
            owners = owners[1:]
        n = len(owners)
        weights = None
        if budgets is not None and len(set(budgets[r] for r in owners)) > 1:
            weights = [Fraction(budgets[r]) for r in owners]
        layers = {}
        for layer, num_experts in experts_per_layer.items():
            if num_experts < n:
                raise PlacementError(
                    f"{n} ranks hold experts but layer {layer} has only "
                    f"{num_experts}: a rank would sit idle; use fewer ranks"
                )
            if weights is None:
                row = [owners[e * n // num_experts] for e in range(num_experts)]
            else:
                row = [owners[i] for i, count in enumerate(proportional_counts(num_experts, weights))
                       for _ in range(count)]
            layers[layer] = [(r,) for r in row]
        return cls(num_ranks, layers)

    def everywhere(self) -> "Placement":
        """Every expert on every rank, each expert's primary where this
        placement puts it (the slots then go to ranks by position:
        ``dispatch/ownership.py``)."""
        ranks = range(self.num_ranks)
        return Placement(self.num_ranks, {layer: [owners[:1] + tuple(r for r in ranks if r != owners[0])
                                                  for owners in row] for layer, row in self.layers.items()})

    @property
    def on_every_rank(self) -> bool:
        """Whether every rank holds every expert of every layer."""
        return all(len(owners) == self.num_ranks for row in self.layers.values() for owners in row)

    def experts_of(self, layer: int, rank: int) -> List[int]:
        """The global ids of the experts ``rank`` holds in ``layer`` (as
        primary or duplicate), ascending."""
        return [e for e, owners in enumerate(self.layers[layer]) if rank in owners]

    @property
    def duplicated(self) -> bool:
        """Whether any expert has more than one holder."""
        return any(len(o) > 1 for row in self.layers.values() for o in row)

    def held_counts(self, num_ranks: Optional[int] = None) -> Dict[int, List[int]]:
        """layer -> [N] experts each rank holds there (duplicates included)."""
        n = self.num_ranks if num_ranks is None else num_ranks
        counts = {}
        for layer, row in self.layers.items():
            counts[layer] = [0] * n
            for owners in row:
                for r in owners:
                    counts[layer][r] += 1
        return counts

    def check_world(self, num_ranks: int) -> None:
        """Raise ``PlacementError`` unless this placement is for a job of
        ``num_ranks`` ranks (what can be checked before the model is read)."""
        if self.num_ranks != num_ranks:
            raise PlacementError(f"placement is for {self.num_ranks} ranks, the job has {num_ranks}")

    def validate(self, experts_per_layer: Dict[int, int], num_ranks: int) -> None:
        """Raise ``PlacementError`` unless this placement fits the model and
        the world: the same MoE layers, every expert held by one or more
        distinct ranks that exist, and no rank left idle where the layer has
        experts to spare."""
        self.check_world(num_ranks)
        if set(self.layers) != set(experts_per_layer):
            missing = sorted(set(experts_per_layer) - set(self.layers))
            extra = sorted(set(self.layers) - set(experts_per_layer))
            raise PlacementError(
                f"placement layers do not match the model's MoE layers "
                f"(missing {missing}, not MoE in the model {extra})"
            )
        for layer, row in sorted(self.layers.items()):
            num_experts = experts_per_layer[layer]
            if len(row) != num_experts:
                raise PlacementError(
                    f"layer {layer}: placement lists {len(row)} experts, "
                    f"the model has {num_experts}"
                )
            for e, owners in enumerate(row):
                _check_owners(owners, num_ranks, f"layer {layer} expert {e}")
        # Rank 0 may hold no experts (it still runs the dense part); any
        # other rank without one would only add latency.
        held = {r for row in self.layers.values() for owners in row for r in owners}
        idle = [r for r in range(1, num_ranks) if r not in held]
        if idle:
            raise PlacementError(
                f"rank(s) {idle} own no expert in any layer; use fewer ranks "
                f"(the model has {min(experts_per_layer.values())} experts per layer)"
            )

    def to_json(self) -> dict:
        """Version 1 where every expert has one owner, else version 2."""
        if not self.duplicated:
            layers = {str(l): [o[0] for o in row] for l, row in sorted(self.layers.items())}
            return {"version": 1, "num_ranks": self.num_ranks, "layers": layers}
        layers = {str(l): [o[0] if len(o) == 1 else list(o) for o in row] for l, row in sorted(self.layers.items())}
        return {"version": 2, "num_ranks": self.num_ranks, "layers": layers}

    @classmethod
    def from_json(cls, obj: Any) -> "Placement":
        """Read a version 1 or 2 object, checking every field's type and
        range (``validate`` then checks it against the model)."""
        if not isinstance(obj, dict):
            raise PlacementError("placement must be a JSON object")
        version = obj.get("version")
        if type(version) is not int or version not in (1, 2):
            raise PlacementError(f"placement version {version!r} is not 1 or {PLACEMENT_VERSION}")
        num_ranks, layers = obj.get("num_ranks"), obj.get("layers")
        if type(num_ranks) is not int or not 1 <= num_ranks <= MAX_RANKS:
            raise PlacementError(f"placement is malformed: num_ranks must be an integer in 1..{MAX_RANKS}, "
                                 f"not {_short(num_ranks)}")
        if not isinstance(layers, dict):
            raise PlacementError("placement is malformed: layers must be an object of layer -> owners")
        parsed: Dict[int, List[Owners]] = {}
        for key, row in layers.items():
            if not is_digits(key, 9):
                raise PlacementError(f"placement is malformed: layer key {_short(key)} is not a layer index")
            if not isinstance(row, list) or not 1 <= len(row) <= MAX_EXPERTS:
                raise PlacementError(f"placement is malformed: layer {key} must list 1..{MAX_EXPERTS} experts' owners")
            owners_row = []
            for e, entry in enumerate(row):
                if version == 1 or type(entry) is int:
                    entry = (entry,)
                elif isinstance(entry, list):
                    entry = tuple(entry)
                else:
                    raise PlacementError(f"placement is malformed: layer {key} expert {e}: {_short(entry)} is "
                                         f"neither a rank nor a list of ranks")
                _check_owners(entry, num_ranks, f"layer {key} expert {e}")
                owners_row.append(entry)
            parsed[int(key)] = owners_row
        return cls(num_ranks, parsed)

    def save(self, path: Union[str, Path]) -> None:
        """Write the file atomically (a reader never sees half of it)."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Placement":
        return cls.from_json(json_input.read_file(path, "placement", PlacementError))


def _check_owners(owners: Owners, num_ranks: int, where: str) -> None:
    if not owners:
        raise PlacementError(f"placement: {where} has no owner")
    for r in owners:
        if type(r) is not int:
            raise PlacementError(f"placement is malformed: {where}: owner {_short(r)} is not a rank number")
        if not 0 <= r < num_ranks:
            raise PlacementError(f"placement: {where}: owner rank {r} does not exist (ranks are 0..{num_ranks - 1})")
    if len(set(owners)) != len(owners):
        raise PlacementError(f"placement: {where} lists a rank twice ({list(owners)})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def proportional_counts(total: int, weights: Sequence[Fraction]) -> List[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties
    to the lower index), each part at least 1 where ``total`` allows."""
    whole = sum(weights)
    if not whole > 0 or any(w < 0 for w in weights):
        raise PlacementError("rank budgets must be positive")
    exact = [Fraction(total) * w / whole for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):  # every rank at least one: from the largest part
        if counts[i] == 0 and total >= len(counts):
            donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] += 1
    return counts


def write_json_atomic(path: Union[str, Path], obj: Any) -> None:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename it over ``path``."""
    import os

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(_dumps_by_layer(obj))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _dumps_by_layer(obj: dict) -> str:
    """JSON with one line per entry of ``layers`` (a placement's or a routing file's)."""
    head = json.dumps({k: v for k, v in obj.items() if k != "layers"})
    rows = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in obj["layers"].items())
    return head[:-1] + ', "layers": {\n' + rows + "\n}}\n"


def resolve_placement(
    placement: Optional[dict],
    experts_per_layer: Dict[int, int],
    num_ranks: int,
    rank0_experts: bool = True,
    budgets: Optional[Sequence[float]] = None,
) -> Placement:
    """The placement a job uses: the given JSON object, or the even policy
    (in proportion to the ranks' ``budgets``, where given)."""
    if placement is None:
        result = Placement.even(experts_per_layer, num_ranks, rank0_experts, budgets)
    else:
        result = Placement.from_json(placement)
    result.validate(experts_per_layer, num_ranks)
    return result
