"""Keeping a Mac awake while it is a rank: a Mac that sleeps mid-job stops
answering, and the others' watchdog ends the job. On macOS each rank starts
``caffeinate -i -w PID`` (an idle-sleep assertion held until this process
ends) unless ``--allow-sleep`` (``MLXDIST_ALLOW_SLEEP``); elsewhere nothing.
"""

import os
import shutil
import subprocess
import sys
from typing import List, Optional

from mlxdist import envs


def command(pid: int) -> List[str]:
    """The sleep assertion for process ``pid``, held until it exits."""
    return ["caffeinate", "-i", "-w", str(pid)]


def hold(platform: str = sys.platform) -> Optional[subprocess.Popen]:
    """Keep this host awake while this process runs (macOS, unless allowed to sleep)."""
    if platform != "darwin" or envs.get("MLXDIST_ALLOW_SLEEP") or shutil.which("caffeinate") is None:
        return None
    return subprocess.Popen(command(os.getpid()), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
