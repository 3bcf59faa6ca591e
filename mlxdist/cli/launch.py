"""``python -m mlxdist.launch ARGS``: MLX's ``mlx.launch ARGS``, exiting
with the job's status.

``mlx.launch`` (MLX 0.32) exits 0 even when every rank failed; it says so
only on its stderr, one line per failed rank: ``Node with rank R exited with
code C`` or ``Node with rank R was killed`` (which it does to the other ranks
once one fails). This runs it with the same arguments, standard input and
output, passes its stderr through as it comes, and exits with the status
of the first rank that failed (a rank ended by signal S counts as 128 + S,
as in a shell; the ranks ``mlx.launch`` stops after it, with SIGTERM, are
not the cause), 1 where ranks were only killed, else ``mlx.launch``'s own
status: ``mpirun``'s rule. The lines come from ``mlx.launch`` on the
host that runs it, for ranks on every host, so this needs no shared disk.

    python -m mlxdist.launch --backend ring -n 4 -- python -m mlxdist.run --model DIR -p "Hello"
"""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

_EXITED = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
_KILLED = re.compile(r"Node with rank (\d+) was killed")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
KILLED = -1  # a rank mlx.launch reports killed (it stops the others once one fails)


def mlx_launch() -> Optional[str]:
    """The ``mlx.launch`` of this Python's environment, else the first on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.is_file() else shutil.which("mlx.launch")


def failures(text: str) -> List[Tuple[int, int]]:
    """(rank, status) of each failure ``mlx.launch`` reported in its stderr
    ``text``, in the order reported: a rank's exit code (128 + S for signal
    S), ``KILLED`` for a rank it stopped."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        exited, killed = _EXITED.search(line), _KILLED.search(line)
        if exited:
            code = int(exited.group(2))
            out.append((int(exited.group(1)), 128 - code if code < 0 else code))
        elif killed:
            out.append((int(killed.group(1)), KILLED))
    return out


def job_status(failed: List[Tuple[int, int]], launcher: int) -> int:
    """The shell status of a job (see the module's docstring)."""
    codes = [c for _, c in failed if c != KILLED]
    if codes:
        return codes[0]
    return 1 if failed else launcher


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    launcher = mlx_launch()
    if launcher is None:
        print("mlxdist: error: mlx.launch is not installed in this environment (pip install mlx)", file=sys.stderr)
        return 1
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n", flush=True)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is mlx.launch's to handle
    try:
        proc = subprocess.Popen([launcher, *args], stderr=subprocess.PIPE)
        reports, partial = [], b""
        while True:
            data = os.read(proc.stderr.fileno(), 1 << 16)
            if not data:
                break
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()
            *lines, partial = (partial + data).split(b"\n")
            reports += [line.decode(errors="replace") for line in lines if b"Node with rank" in line]
            partial = partial[-4096:]  # a rank's line without its end (a progress bar) is no report
        status = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return job_status(failures("\n".join(reports + [partial.decode(errors="replace")])), status)
