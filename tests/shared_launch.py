"""Runs of tests/scripts/several.py shared by a whole test session: one
launch per world size instead of one per test module, since starting the
ranks (importing mlx-lm on each) costs more than most runs.

A test module declares its runs at import, each under a name:
``declare(module, nranks, name, make)``, where ``make(checkpoint,
tmp_path_factory)`` returns a several.py step ``(script, args[, grouped])``
and a function that reads the step's result. The first ``result(request,
nranks, name)`` for a world size launches every run declared for it by a
module with tests in this session (and the one asked for), one after
another on one launch; later calls read their own run's share. A launch
that failed fails every run it held, once.
"""

import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from conftest import ROOT, last_json, launch

SEVERAL = ROOT / "tests/scripts/several.py"
Make = Callable[[Any, Any], Tuple[tuple, Callable[[Any], Any]]]
_DECLARED: Dict[int, Dict[str, Tuple[str, Make]]] = {}  # nranks -> name -> (module, make)
_RESULTS: Dict[int, Dict[str, Any]] = {}  # nranks -> name -> its result, read (or the launch's failure)


def launch_several(nranks: int, steps, timeout: float = 300, env: dict = None):
    """One launch of several.py on ``nranks`` ranks running ``steps``, each
    (script, args) or (script, args, grouped); returns the finished launch."""
    encoded = [{"script": s[0], "args": list(map(str, s[1])), "grouped": s[2] if len(s) > 2 else None} for s in steps]
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "steps.json"
        plan.write_text(json.dumps(encoded))
        return launch(nranks, [SEVERAL, plan], module=None, timeout=timeout, env=env)


def several(nranks: int, steps, timeout: float = 300, env: dict = None) -> List[Any]:
    """Each step's result from one launch of several.py on ``nranks`` ranks (``launch_several``)."""
    proc = launch_several(nranks, steps, timeout, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)["steps"]


def declare(module: str, nranks: int, name: str, make: Make) -> None:
    """Add run ``name`` of test module ``module`` to the launch at ``nranks`` ranks."""
    _DECLARED.setdefault(nranks, {})[name] = (module, make)


def grouping(make: Make, value: str) -> Make:
    """``make``'s run with MLXDIST_GROUPED_EXPERTS as if set to ``value`` on
    every rank for it (several.py's "grouped")."""

    def grouped_make(checkpoint, tmp_path_factory):
        (script, args, *_), read = make(checkpoint, tmp_path_factory)
        return (script, args, value), read

    return grouped_make


class _Failed:
    def __init__(self, error: AssertionError):
        self.error = error


def result(request, nranks: int, name: str) -> Any:
    """Run ``name``'s result (``request``: the asking test's pytest request)."""
    done = _RESULTS.setdefault(nranks, {})
    if name not in done:
        modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
        made = {n: make(request.getfixturevalue("checkpoint"), request.getfixturevalue("tmp_path_factory"))
                for n, (module, make) in _DECLARED[nranks].items()
                if n not in done and (n == name or module in modules)}
        try:
            results = several(nranks, [step for step, _ in made.values()], timeout=120 + 30 * len(made))
        except AssertionError as e:
            done.update({n: _Failed(e) for n in made})
        else:
            done.update({n: read(r) for (n, (_, read)), r in zip(made.items(), results)})
    if isinstance(done[name], _Failed):
        raise done[name].error
    return done[name]
