"""Budgets given by hand (``--rank-memory``, ``load(rank_memory_gb=...)``):
the GB of expert weights each rank may keep resident, read in one of three
forms and matched to the job's ranks in one place, ``budgets_for_ranks``.

- per rank, in rank order: ``A,B,...`` (API: a list);
- per host: ``HOST=GB,HOST=GB`` (API: a dict), or a JSON hostfile in
  ``mlx.launch``'s forms whose every host carries ``"memory_gb"``.

A host's budget is its own, whatever number of ranks it runs: it is split
evenly over them. Budgets per host are matched to ranks by host name, never
by position: names are compared without case or domain (``mac1.local`` is
``Mac1``; an IP address is compared whole), and a rank on a host the budgets
do not name is refused in one line naming the rank and its host.
"""

import ipaddress
from typing import Dict, List, Optional, Sequence, Tuple, Union

from mlxdist.inputs import json_input
from mlxdist.inputs.digits import parse_number
from mlxdist.errors import PlacementError

Budgets = Union[List[float], Dict[str, float]]  # GB per rank, or GB by host name


def parse_rank_memory(text: str, num_ranks: Optional[int] = None) -> Budgets:
    """``--rank-memory``: ``A,B,...`` -> GB per rank (``num_ranks`` of them,
    where given); ``HOST=GB,...`` or a JSON hostfile (``*.json``) -> GB by host name."""
    if text.endswith(".json"):
        return by_host(read_hostfile_budgets(text), f"--rank-memory {text}")
    if "=" in text:
        return by_host([_host_budget(part) for part in text.split(",")], "--rank-memory")
    try:
        budgets = [parse_number(part.strip(), "a budget") for part in text.split(",")]
    except ValueError:
        raise PlacementError(f"--rank-memory takes GB per rank separated by commas (e.g. 64,32), HOST=GB per "
                             f"host, or a JSON hostfile, not {text!r:.40}") from None
    if not all(_positive(b) for b in budgets):
        raise PlacementError(f"--rank-memory budgets must be positive numbers of GB, not {text!r:.40}")
    if num_ranks is not None and len(budgets) != num_ranks:
        raise PlacementError(f"--rank-memory gives {len(budgets)} budgets for {num_ranks} ranks")
    return budgets


def read_hostfile_budgets(path: str) -> List[Tuple[str, float]]:
    """(host name, ``memory_gb``) per entry of a JSON hostfile, in order: a
    list of hosts, or ``mlx.distributed_config``'s object (``{"backend",
    "envs", "hosts": [...]}``). A host's name is its ``"ssh"``, else the
    first of its ``"ips"``."""
    hosts = json_input.read_file(path, "--rank-memory host", PlacementError)
    if isinstance(hosts, dict) and "hosts" in hosts:
        hosts = hosts["hosts"]
    if not isinstance(hosts, list) or not hosts:
        raise PlacementError(f"hostfile {path} must be a JSON list of hosts or an object with \"hosts\" "
                             f"(mlx.launch's forms)")
    out = []
    for i, host in enumerate(hosts):
        gb = host.get("memory_gb") if isinstance(host, dict) else None
        if isinstance(gb, bool) or not isinstance(gb, (int, float)):
            raise PlacementError(f"hostfile {path}: host {i} has no number \"memory_gb\" "
                                 f"(GB of expert weights it may keep resident)")
        if not _positive(gb):
            raise PlacementError(f"hostfile {path}: host {i}'s memory_gb must be positive, not {gb!r}")
        name = host.get("ssh") or (host.get("ips") or [None])[0]
        if not isinstance(name, str) or not name:
            raise PlacementError(f"hostfile {path}: host {i} has no \"ssh\" name to match ranks by")
        out.append((name, float(gb)))
    return out


def by_host(pairs: Sequence[Tuple[str, float]], what: str = "--rank-memory") -> Dict[str, float]:
    """GB by host name from (name, GB) pairs: a host named more than once
    (``mlx.launch``'s hostfile lists a host once per rank) must be given
    the same budget each time."""
    out: Dict[str, float] = {}
    seen: Dict[str, str] = {}
    for name, gb in pairs:
        key = host_key(name)
        if key in seen and out[seen[key]] != gb:
            raise PlacementError(f"{what} gives host {name} two budgets ({out[seen[key]]:g} and {gb:g} GB)")
        if key not in seen:
            seen[key] = name
            out[name] = float(gb)
    return out


def budgets_for_ranks(budgets: Budgets, rank_hosts: Sequence[str]) -> List[float]:
    """[N] GB per rank, for ranks on ``rank_hosts`` (each rank's host name,
    in rank order): a list as given (one per rank); GB by host name matched
    to each rank's host (see the module's docstring), a host's GB split
    evenly over the ranks it runs. Raises ``PlacementError`` (one line) for
    a list of another length, or naming the first rank whose host is not named."""
    if not isinstance(budgets, dict):
        if len(budgets) != len(rank_hosts):
            raise PlacementError(f"--rank-memory gives {len(budgets)} budgets for {len(rank_hosts)} ranks")
        return [float(b) for b in budgets]
    named = {host_key(name): gb for name, gb in by_host(list(budgets.items())).items()}
    keys = [host_key(h) for h in rank_hosts]
    out = []
    for rank, (host, key) in enumerate(zip(rank_hosts, keys)):
        if key not in named:
            raise PlacementError(f"rank {rank} runs on host {host}, which --rank-memory does not name (it names "
                                 f"{', '.join(sorted(budgets))[:80]})")
        out.append(named[key] / keys.count(key))
    return out


def host_key(name: str) -> str:
    """What a host name is compared by: lower case, without its domain
    (``Mac1.local`` -> ``mac1``); an IP address whole."""
    name = name.strip().lower()
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        return name.split(".")[0]


def _host_budget(part: str) -> Tuple[str, float]:
    """One ``HOST=GB`` of ``--rank-memory``."""
    name, _, gb = part.partition("=")
    try:
        value = parse_number(gb.strip(), "a budget", above=0)
    except ValueError:
        value = 0.0
    if not name.strip() or not _positive(value):
        raise PlacementError(f"--rank-memory takes HOST=GB per host separated by commas, not {part!r:.40}")
    return name.strip(), value


def _positive(gb: float) -> bool:
    return 0 < gb < float("inf")
