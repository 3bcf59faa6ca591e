"""The ``--out`` file of a job run: one JSON record per finished job,
appended and fsynced, held by one run at a time (``flock``); a rerun cuts off
a half-written last line, reports and ignores damaged lines, and skips the
ids already recorded (error records too, unless ``retry_errors``).
"""

import errno
import fcntl
import json
import os
import sys
from typing import Any, Dict, Optional, Set, Tuple

from tqdm import tqdm

from mlxdist.errors import OutputError, UserError

from mlxdist.cli.job_file import bounded_lines, open_regular, parse_json_line


# -- the output -------------------------------------------------------------

def read_record(raw: bytes) -> Tuple[Optional[str], Optional[bool], str]:
    """One output line: (id, whether it is an error record, why not) where
    it is damaged the id is None and the third item says why."""
    try:
        obj = parse_json_line(raw)
    except ValueError as e:
        return None, None, str(e).removeprefix("is ")
    if not isinstance(obj, dict):
        return None, None, "not a JSON object"
    if not isinstance(obj.get("id"), str):
        return None, None, "no id"
    if "error" not in obj and "tokens" not in obj:
        return None, None, "neither a result nor an error record"
    return obj["id"], "error" in obj, ""


def read_output(path: str, warn=None) -> Tuple[Set[str], Set[str]]:
    """(ids with a result, ids with only error records) in the output's
    complete lines; ``warn(message)`` is called for each damaged line. Reads
    only, so it is safe while a run appends to the file."""
    results: Set[str] = set()
    errors: Set[str] = set()
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return results, errors
    with f:
        for lineno, raw, ended in bounded_lines(f):
            if not ended:
                break  # a half-written last line (cut off by the run that holds the file)
            jid, is_error, why = read_record(raw)
            if jid is None:
                if warn is not None:
                    warn(f"{path} line {lineno} is damaged ({why}): ignored; a job recorded only there runs again")
            elif is_error:
                errors.add(jid)
            else:
                results.add(jid)
    return results, errors - results


def recorded_ids(out_path: str, retry_errors: bool = False) -> Set[str]:
    """Ids the output holds as finished: with a result, or (unless
    ``retry_errors``) with an error record; damaged lines are skipped."""
    results, errors = read_output(out_path)
    return results if retry_errors else results | errors


def lock_holder(path: str) -> Optional[int]:
    """The pid holding a ``flock`` on ``path``, from /proc/locks (Linux);
    None where it cannot be told."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            table = f.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    by_inode = None
    for row in table:
        fields = row.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].lstrip("-").isdigit():
            continue
        if fields[5] == device:
            return int(fields[4])
        if fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
            by_inode = int(fields[4])  # an overlay file system may show another device
    return by_inode


def warn(message: str) -> None:
    """``mlxdist: warning: <message>`` on stderr in one write, above the progress bar."""
    sys.stderr.flush()
    with tqdm.external_write_mode(file=sys.stderr):
        os.write(sys.stderr.fileno(), f"mlxdist: warning: {message}\n".encode("utf-8", "backslashreplace"))


class ResultsFile:
    """The ``--out`` file, held by one run: locked (``flock``, not waiting),
    its half-written last line cut off, its records read, then appended to,
    each record durable before the next."""

    def __init__(self, path: str):
        self.path = path
        self.file = open_regular(path, "--out", os.O_RDWR | os.O_APPEND | os.O_CREAT, "a+b")
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.file.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock {path}: {e.strerror}") from None
            holder = lock_holder(path)
            raise UserError(f"{path} is being written by another run (pid {holder if holder else 'unknown'})") \
                from None
        self._repair()

    def _repair(self) -> None:
        self.file.seek(0)
        end = 0
        for _, raw, ended in bounded_lines(self.file):
            if not ended:
                self.file.truncate(end)
                warn(f"repaired {self.path}: dropped a half-written last line")
                return
            end = self.file.tell()

    def finished(self, retry_errors: bool) -> Set[str]:
        """Ids not to run again (damaged lines reported and ignored)."""
        results, errors = read_output(self.path, warn=warn)
        return results if retry_errors else results | errors

    def write(self, record: Dict[str, Any]) -> None:
        """Append one record and make it durable; ``OutputError`` where the
        file will not take it (a full disk: what was written of it is a
        half-written last line, which the next run cuts off). Written past
        the file object's buffer, so a failed write is not tried again at
        close."""
        line = memoryview(json.dumps(record).encode() + b"\n")
        try:
            while line:
                line = line[os.write(self.file.fileno(), line):]
            os.fsync(self.file.fileno())
        except OSError as e:
            raise OutputError(f"cannot write {self.path}: {e.strerror}; the run stops (a rerun resumes after the "
                              f"records written)") from None

    def close(self) -> None:
        """Release the file (and its lock)."""
        self.file.close()
