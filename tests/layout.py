"""The package's layout, read from its source with ``ast``: each subpackage and
top-level module of ``mlxdist/`` with its line count, and the import arrows
between them, function-level imports included.

    python tests/layout.py              # this checkout's mlxdist/
    python tests/layout.py DIR/mlxdist  # another copy's
    python tests/layout.py --doc        # without line counts, as docs/architecture.md holds it

prints the picture ``docs/architecture.md`` holds (tests/test_shape.py checks
that it is the current one). An arrow that runs up a layer is marked ``UP``;
an arrow inside an import circle between units, ``CIRCLE``. Module-level
circles (between single files) are listed at the end.

A *unit* is a subpackage (``mlxdist/engine/``) or a top-level module
(``mlxdist/api.py``); the layers are ``LAYERS`` below, bottom up.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxdist"

# The layers, bottom up: a unit may import from its own layer or below.
# Entry points (the command lines, the shims, the tools) sit on top.
LAYERS: list[set[str]] = [
    {"mlxdist.envs", "mlxdist.errors", "mlxdist.inputs", "mlxdist.compat", "mlxdist.synth"},
    {"mlxdist.runtime", "mlxdist.values"},
    {"mlxdist.dispatch"},
    {"mlxdist.config", "mlxdist.ship"},
    {"mlxdist.model"},
    {"mlxdist.decide"},
    {"mlxdist.engine"},
    {"mlxdist.serving"},
    {"mlxdist.commands"},
    {"mlxdist.api"},
    {"mlxdist.cli", "mlxdist.bench", "mlxdist.run", "mlxdist.serve", "mlxdist.supervise", "mlxdist.place",
     "mlxdist.doctor", "mlxdist.cache", "mlxdist.launch", "mlxdist.front"},
]
LAYER_NAMES = [
    "foundations (errors, variables, mlx-lm's private names, text read from outside, test checkpoints)",
    "the job's ranks and control plane; value types",
    "the exchange between ranks (dispatchers)",
    "the options a load takes; how the model reaches every rank",
    "the model on one rank",
    "auto's decisions",
    "generation",
    "the server on every rank",
    "what every rank does with each command",
    "the Python API",
    "entry points and tools",
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _resolve(module: str, name: str) -> str:
    """``from module import name``: the submodule where ``name`` is one, else ``module``."""
    sub = PACKAGE.parent / f"{module}.{name}".replace(".", "/")
    return f"{module}.{name}" if sub.with_suffix(".py").exists() or sub.is_dir() else module


def imports(path: Path) -> dict[str, bool]:
    """{mlxdist module imported: whether at module level} for one file, every
    import statement in it (``ast.walk``: functions and methods included),
    but those under ``if TYPE_CHECKING:`` (type hints only: nothing runs them)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    hints_only = {id(inner) for node in ast.walk(tree)
                  if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                  for stmt in node.body for inner in ast.walk(stmt)}
    found: dict[str, bool] = {}
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        names = []
        if id(node) in hints_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base == "mlxdist" or base.startswith("mlxdist."):
                names = [_resolve(base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name == "mlxdist" or a.name.startswith("mlxdist.")]
        for name in names:
            found[name] = found.get(name, False) or id(node) in top
    return found


def module_graph() -> dict[str, set[str]]:
    """{module: {mlxdist modules it imports anywhere in its text}}; the package's
    own ``__init__`` is left out as a target (importing anything imports it)."""
    graph = {}
    for path in modules():
        name = module_name(path)
        graph[name] = set(imports(path)) - {name, "mlxdist"}
    return graph


def unit(module: str) -> str:
    """The subpackage or top-level module a module belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def layer(module: str) -> int:
    if module == "mlxdist":  # the package's __init__: the public names, re-exported lazily (a facade on
        return len(LAYERS) - 1  # top; nothing imports it by name: importing any module imports it)
    for i, names in enumerate(LAYERS):
        if unit(module) in names:
            return i
    raise KeyError(f"{module} is in no layer of tests/layout.py")


def unit_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """{(unit, unit it imports): the module arrows behind it}."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            a, b = unit(module), unit(dep)
            if a != b and a != "mlxdist":
                arrows.setdefault((a, b), []).append(f"{module} -> {dep}")
    return arrows


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def top_level_modules() -> list[str]:
    return sorted(p.name for p in PACKAGE.glob("*.py"))


def picture(counts: bool = True) -> str:
    """The layout as text: units by layer (with their line counts where
    ``counts``), their arrows, the marks. ``docs/architecture.md`` holds it
    without the counts, which change with every edit."""
    graph = module_graph()
    arrows = unit_graph(graph)
    units: dict[str, int] = {}
    for path in modules():
        name = unit(module_name(path))
        if name != "mlxdist":
            units[name] = units.get(name, 0) + len(path.read_text().splitlines())
    unit_deps: dict[str, set[str]] = {}
    for a, b in arrows:
        unit_deps.setdefault(a, set()).add(b)
    in_circle = {frozenset(c) for c in circles(unit_deps)}
    top = top_level_modules()
    lines = [f"mlxdist/: {len(units)} units" + (f", {sum(units.values())} lines" if counts else "")
             + f", {len(top)} top-level modules ({', '.join(top)})", ""]
    up = 0
    circled = 0
    for i in range(len(LAYERS) - 1, -1, -1):
        members = sorted(u for u in units if layer(u) == i)
        lines.append(f"layer {i}: {LAYER_NAMES[i]}")
        for u in members:
            short = u.removeprefix("mlxdist.")
            kind = "/" if (PACKAGE / short).is_dir() else ".py"
            targets = []
            for b in sorted(unit_deps.get(u, ())):
                marks = []
                if layer(b) > layer(u):
                    marks.append("UP")
                    up += 1
                if any(u in c and b in c for c in in_circle):
                    marks.append("CIRCLE")
                    circled += 1
                targets.append(b.removeprefix("mlxdist.") + (f" [{' '.join(marks)}]" if marks else ""))
            size = f" {units[u]:>5}" if counts else ""
            lines.append(f"  {short + kind:<14}{size}  -> {', '.join(targets) if targets else '-'}")
    lines.append("")
    module_circles = circles(graph)
    lines.append(f"{len(arrows)} arrows between units, {up} up a layer, {circled} in a circle; "
                 f"{len(module_circles)} import circles between modules")
    for c in module_circles:
        lines.append("  circle: " + " <-> ".join(m.removeprefix("mlxdist.") for m in c))
    for (a, b), behind in sorted(arrows.items()):
        if layer(b) > layer(a):
            lines.append(f"  up: {'; '.join(sorted(behind))}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    doc = "--doc" in args  # the picture docs/architecture.md holds: no line counts
    rest = [a for a in args if a != "--doc"]
    if rest:  # another copy of the package, e.g. one `git archive` wrote
        PACKAGE = Path(rest[0]).resolve()
    sys.stdout.write(picture(counts=not doc))
