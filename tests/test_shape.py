"""The product's shape, checked: every environment variable registered, no
dispatch-mode name decided outside dispatch/, decide/ and the argument parsers, one
error hierarchy, the dispatch interface complete, and mlx.launch running one
job (real mlx.launch on localhost)."""

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import layout
from conftest import ROOT, error_lines, mpirun_env

PACKAGE = ROOT / "mlxdist"


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_environment_variable_is_in_the_registry():
    """No module but envs.py reads or sets os.environ (copies for a child
    process excepted); every name given to envs is registered; every
    registered name is used somewhere; docs/environment.md is the registry's."""
    from mlxdist import envs

    used = set()
    for path in _modules():
        if path.name == "envs.py":
            continue
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "environ":
                parent = parents[node]
                whole_copy = (isinstance(parent, ast.Call) and parent.func.id == "dict") if isinstance(
                    getattr(parent, "func", None), ast.Name) else isinstance(parent, ast.Dict)
                assert whole_copy, f"{path.relative_to(ROOT)}:{node.lineno} touches os.environ (use mlxdist.envs)"
            if isinstance(node, ast.Attribute) and node.attr == "getenv":
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} calls os.getenv (use mlxdist.envs)")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "envs" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                name = node.args[0].value
                assert name in envs.VARIABLES, f"{path.relative_to(ROOT)}:{node.lineno}: {name} is not registered"
                used.add(name)
    text = "\n".join(p.read_text() for p in _modules() if p.name != "envs.py")
    text += (ROOT / "launch" / "mpirun").read_text()
    if "envs.MPI_START" in text or "mpi_start_defaults" in text:  # the MPI start settings, used by their list
        used |= set(envs.MPI_START)
    unused = [name for name in envs.VARIABLES if name not in used and name not in text]
    assert not unused, f"registered but never used: {unused}"
    assert (ROOT / "docs" / "environment.md").read_text() == envs.markdown(), \
        "docs/environment.md is stale: python -m mlxdist.envs > docs/environment.md"


def test_envs_reads_types_and_defaults(monkeypatch):
    from mlxdist import envs

    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    assert envs.get("NCCL_MAX_NCHANNELS") == 2
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "4")
    assert envs.get("NCCL_MAX_NCHANNELS") == 4
    monkeypatch.setenv("MLXDIST_DEBUG", "yes")
    assert envs.get("MLXDIST_DEBUG") is True
    with pytest.raises(KeyError):
        envs.setdefault("MLXDIST_DEBUG", "1")  # mlxdist reads it; it never sets it
    with pytest.raises(KeyError):
        envs.is_set("SOMETHING_UNREGISTERED")


# A mode's name compared (==, !=, in) or used as a dict key anywhere outside
# dispatch/, decide/ (auto's rule) and the parsers is a decision that belongs
# to the interface.
_MODE = r"""["'](?:auto|collective|collective-tp|p2p|dp)["']"""
_DECISION = re.compile(rf"(==|!=|\bin\b)\s*\(?{_MODE}|{_MODE}\s*(==|!=|\bin\b)|\[{_MODE}\]")


def test_no_mode_name_decides_outside_dispatch():
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("dispatch", "decide"):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if "add_argument" in line or "choices=" in line:
                continue  # the argument parsers
            if _DECISION.search(line):
                offenders.append(f"mlxdist/{rel}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_one_error_hierarchy():
    """Every exception class mlxdist defines derives from MlxdistError, in errors.py."""
    from mlxdist import errors

    defined = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", "").endswith(("Error", "Exception")) or getattr(b, "id", "") in dir(errors)
                    for b in node.bases):
                defined.append((path.relative_to(ROOT), node.name))
    outside = [(p, n) for p, n in defined if str(p) != "mlxdist/errors.py"]
    assert not outside, f"exception classes outside errors.py: {outside}"
    for name, obj in vars(errors).items():
        if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == "mlxdist.errors":
            assert issubclass(obj, errors.MlxdistError), name
    assert errors.one_line(errors.PlacementError("bad placement\nmore")) == "bad placement"
    assert errors.one_line(KeyError("x")) == "KeyError: 'x'"


def test_every_strategy_declares_what_it_is():
    """Each dispatcher says what combine returns, who runs the dense model,
    whether it is exact and whether it survives a lost rank."""
    from mlxdist.dispatch import Combine, DenseRanks, Dispatcher, make_dispatcher
    from mlxdist.dispatch.base import RowDispatcher
    from mlxdist.runtime.world import World

    class Two(World):  # two ranks as far as the dispatchers' declarations go; no collective runs
        pass

    world = Two(0, 2, None)
    seen = {}
    for mode in ("collective", "collective-tp", "p2p", "dp"):
        for width in ((False, True) if mode != "p2p" else (False,)):
            d = make_dispatcher(mode, world, "masked", wraps_blocks=width, top_k=2)
            assert isinstance(d, Dispatcher) and d.name == mode
            seen[(mode, width)] = (d.combines, d.dense_ranks, d.exact, d.survives_rank_loss, d.splits_attention)
    assert seen[("collective", False)] == (Combine.SLOTS, DenseRanks.ALL, True, False, False)
    assert seen[("collective", True)][:3] == (Combine.BLOCKS, DenseRanks.ALL, False)
    assert seen[("collective-tp", False)] == (Combine.SLOTS, DenseRanks.ALL, False, False, True)
    assert seen[("p2p", False)] == (Combine.SLOTS, DenseRanks.ROOT, True, True, False)
    assert seen[("dp", False)] == (Combine.TOKENS, DenseRanks.OWN, False, False, False)
    assert seen[("dp", True)][:2] == (Combine.BLOCKS, DenseRanks.OWN)
    assert issubclass(type(make_dispatcher("dp", world, "masked", top_k=2)), RowDispatcher)


def _mlx_launch(args, timeout=120):
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "--", sys.executable,
           "-m", "mlxdist.run", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpirun_env(), cwd=ROOT,
                          stdin=subprocess.DEVNULL)


def test_mlx_launch_runs_one_job_over_mlx_collectives(checkpoint):
    """mlx.launch (ring, no MPI) starts one two-rank job, its control plane on
    MLX's collectives: rank 0 alone prints, the tokens are mlx-lm's."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import stream_generate

    path = checkpoint("qwen3_moe")
    proc = _mlx_launch(["--model", path, "-p", "Hello", "-m", "6", "--mode", "collective", "--json",
                        "--ignore-chat-template"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(results) == 1 and results[0]["num_ranks"] == 2, proc.stdout
    model, tokenizer = load(str(path))
    alone = [r.token for r in stream_generate(model, tokenizer, mx.array(tokenizer.encode("Hello")), max_tokens=6)]
    assert results[0]["tokens"] == alone


def test_mlx_launch_refuses_what_needs_mpi_in_one_line(checkpoint):
    """p2p exchanges experts over mpi4py, which mlx.launch does not start."""
    proc = _mlx_launch(["--model", checkpoint("qwen3_moe"), "-p", "Hello", "-m", "4", "--mode", "p2p"])
    lines = error_lines(proc.stderr)
    assert "rank 0 exited with code 1" in proc.stderr, proc.stderr[-2000:]  # mlx.launch itself returns 0
    assert len(lines) == 1 and "--mode p2p exchanges experts over MPI" in lines[0], proc.stderr[-2000:]
    assert proc.stdout.strip() == "", proc.stdout


# The layers are tests/layout.py's (python tests/layout.py draws them). Every
# import counts, function-level ones too; type-only ones (under TYPE_CHECKING)
# do not. The arrows that may close a circle or run up a layer, and why:
ALLOWED_ARROWS = {
    ("mlxdist.errors", "mlxdist.envs"): "keep_traceback reads MLXDIST_DEBUG and MLXDIST_LOG_DIR through the one "
                                        "registry (envs.py), which reports a bad value with errors.BadVariable: "
                                        "one registry and one error hierarchy, each checked above",
    ("mlxdist.cli.serve", "mlxdist.front"): "serve --ranks N hands its command line to the front, which reads "
                                            "serve's own parser so that both take the same options",
}


def _graph_without_allowed_arrows():
    graph = layout.module_graph()
    for module, dep in ALLOWED_ARROWS:
        assert dep in graph.get(module, ()), f"{module} -> {dep} is allowed but no longer there: drop it"
        graph[module] = graph[module] - {dep}
    return graph


def test_layers_import_only_downwards_and_no_circles():
    graph = _graph_without_allowed_arrows()
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if layout.layer(d) > layout.layer(m)]
    assert not upward, "imports that run up a layer: " + ", ".join(sorted(upward))
    circles = layout.circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_function_level_imports_count():
    """The graph reads every import statement, not the module's body alone."""
    graph = layout.module_graph()
    assert "mlxdist.envs" in graph["mlxdist.errors"]  # keep_traceback's, inside the function


def test_at_most_twelve_top_level_modules():
    top = layout.top_level_modules()
    assert len(top) <= 12, f"{len(top)} modules at mlxdist/'s top level: {', '.join(top)}"


def test_the_layout_picture_in_the_docs_is_the_codes():
    """docs/architecture.md holds what python tests/layout.py --doc prints."""
    assert "```\n" + layout.picture(counts=False) + "```\n" in (ROOT / "docs" / "architecture.md").read_text(), \
        "docs/architecture.md's layout is stale: put python tests/layout.py --doc in its place"


def test_mlx_launch_runs_a_job_file_as_mpirun_does(checkpoint, tmp_path):
    """A job file under mlx.launch (ring, the control plane on MLX's
    collectives): every id once, each record's tokens those of the same
    file under mpirun."""
    from conftest import launch
    from test_jobs import read_records, write_jobs

    path = checkpoint("qwen3_moe")
    jobs = tmp_path / "jobs.jsonl"
    write_jobs(jobs, 5)
    outs = {}
    for name in ("mlx.launch", "mpirun"):
        outs[name] = tmp_path / f"{name}.jsonl"
        args = ["--model", path, "--jobs", jobs, "--out", outs[name], "-m", 6, "--batch-size", 2,
                "--mode", "collective"]
        proc = _mlx_launch(args) if name == "mlx.launch" else launch(2, args)
        assert proc.returncode == 0 and "exited with code" not in proc.stderr, proc.stderr[-2000:]
    got, expected = ({r["id"]: r["tokens"] for r in read_records(outs[n])} for n in ("mlx.launch", "mpirun"))
    assert sorted(got) == [f"job-{i}" for i in range(5)] and got == expected
