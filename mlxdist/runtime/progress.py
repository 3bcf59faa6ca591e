"""Progress of a load's long stages (downloading the model, sending ranks
their shares, reading the experts), on stderr of the rank doing the work
(rank 0, or the rank that sends shares): a tqdm bar with bytes and rate
on a terminal, one line per stage when stderr is not a terminal, nothing
when quiet (``--quiet``, ``set_quiet``)."""

import sys
import time
from typing import Optional

_QUIET = False


def set_quiet(quiet: bool) -> None:
    """No progress from now on (``--quiet``)."""
    global _QUIET
    _QUIET = bool(quiet)
    if _QUIET:  # the hub's own download bars too
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def quiet() -> bool:
    return _QUIET


def say(line: str) -> None:
    """One line about the load, unless quiet."""
    if not _QUIET:
        print(f"mlxdist: {line}", file=sys.stderr, flush=True)


class Stage:
    """One stage of ``total`` bytes: ``update(n)`` as bytes are done, then
    ``close()`` (or use it as a context manager)."""

    def __init__(self, what: str, total: int, show: bool = True):
        self.what, self.total, self.done = what, total, 0
        self.start = time.perf_counter()
        self.show = show and not _QUIET
        self.bar: Optional[object] = None
        if self.show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"mlxdist: {what}", unit="B", unit_scale=True, unit_divisor=1000,
                            leave=True, file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.show:
            seconds = time.perf_counter() - self.start
            rate = f", {self.done / seconds / 1e9:.3g} GB/s" if seconds > 0 and self.done else ""
            say(f"{self.what}: {self.done / 1e9:.3g} GB in {seconds:.1f} s{rate}")

    def __enter__(self) -> "Stage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
