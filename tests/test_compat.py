"""mlx-lm's private names, in one place (mlxdist/compat.py): this mlx-lm
still has each as mlxdist uses it (else the test names what changed), no
module imports one elsewhere, and mlxdist gives mlx-lm's functions its own
names without changing mlx-lm's modules."""

import re

import pytest

from conftest import ROOT
from mlxdist import compat

# mlx-lm classes mlxdist subclasses or reaches into: their private members must be in compat.MEMBERS.
CLASSES = [("mlx_lm.server", "ResponseGenerator"), ("mlx_lm.server", "ModelProvider"),
           ("mlx_lm.server", "APIHandler"), ("mlx_lm.server", "GenerationContext"),
           ("mlx_lm.server", "TimeBudget"), ("mlx_lm.tokenizer_utils", "TokenizerWrapper"),
           ("mlx_lm.generate", "BatchGenerator"), ("mlx_lm.generate", "PromptProcessingBatch"),
           ("mlx_lm.models.cache", "LRUPromptCache")]


def test_mlx_lm_has_every_private_name_mlxdist_uses():
    problems = compat.check()
    assert not problems, ("this mlx-lm changed private names mlxdist uses (update mlxdist/compat.py and its "
                          "callers):\n  " + "\n  ".join(problems))


def test_a_changed_name_is_named():
    """What check() says when a release renames a parameter or drops a lookup."""

    def moved(cache_b, cache_a):
        return cache_a

    assert compat._check_params("mlx_lm.generate._extend_cache", moved, ("cache_a", "cache_b")) == [
        "mlx_lm.generate._extend_cache takes (cache_b, cache_a), mlxdist passes (cache_a, cache_b)"]
    assert compat._check_params("mlx_lm.utils._download", None, ("path_or_hf_repo",)) == [
        "mlx_lm.utils._download is gone"]
    with pytest.raises(RuntimeError, match="no longer looks up BatchGenerator"):
        compat.with_globals(moved, BatchGenerator=object)


def _sources():
    for path in sorted((ROOT / "mlxdist").rglob("*.py")):
        if path.name != "compat.py":
            yield path.relative_to(ROOT), path.read_text()


def test_private_mlx_lm_names_go_through_compat_only():
    """No module but compat imports an underscored mlx-lm name or reads one
    off an mlx-lm module; every private member of an mlx-lm class that a
    module overrides, calls or reads is listed in compat.MEMBERS."""
    import importlib
    import inspect

    found = []
    for rel, text in _sources():
        for m in re.finditer(r"from (mlx_lm[\w.]*) import ([^\n]+)", text):
            found += [f"{rel}: {m.group(1)}.{n.strip()}" for n in m.group(2).split(",")
                      if n.strip().split(" ")[0].startswith("_")]
        found += [f"{rel}: {m.group(0)}" for m in re.finditer(r"\blm_server\._\w+|\bmlx_lm(?:\.\w+)*\._\w+", text)]
    assert not found, "private mlx-lm names used outside mlxdist/compat.py: " + "; ".join(found)
    listed = {name for _, _, name, _ in compat.MEMBERS}
    private = {}
    for module, cls_name in CLASSES:
        cls = getattr(importlib.import_module(module), cls_name)
        names = {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
        names |= set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", inspect.getsource(cls)))
        for n in names:
            private.setdefault(n, f"{module}.{cls_name}")
    subclass = re.compile(r"class \w+\((?:\w+\.)?(?:" + "|".join(c for _, c in CLASSES) + r")\)")
    unlisted = set()
    for rel, text in _sources():
        used = set(re.findall(r"\.(_[a-z]\w*)\b", text)) | set(re.findall(r"def (_[a-z]\w*)\(self", text))
        if not subclass.search(text):  # a module's own private names are its own
            used -= set(re.findall(r"def (_[a-z]\w*)\(", text))
        unlisted |= {f"{private[n]}.{n} ({rel})" for n in used if n in private and n not in listed}
    assert not unlisted, "private members of mlx-lm classes used but not listed in compat.MEMBERS: " + \
        ", ".join(sorted(unlisted))


def test_mlx_lm_server_is_reached_through_compat_only():
    """mlx-lm's server promises none of its names: no module but compat
    (nor a test) imports it, every name of it mlxdist reads through compat
    is in compat.SERVER, and the installed mlx-lm has each (check())."""
    imports = re.compile(r"^\s*(?:from mlx_lm import [^\n]*\bserver\b|from mlx_lm\.server import|import mlx_lm\.server)",
                         re.M)
    tests = [(p.relative_to(ROOT), p.read_text()) for p in sorted((ROOT / "tests").rglob("*.py"))
             if p.name != "test_compat.py"]
    found = [str(rel) for rel, text in [*_sources(), *tests] if imports.search(text)]
    assert not found, "mlx_lm.server imported outside mlxdist/compat.py: " + ", ".join(found)
    used = {(rel, n) for rel, text in _sources() for n in re.findall(r"\bcompat\.(\w+)", text)}
    unknown = sorted(f"{rel}: compat.{n}" for rel, n in used if not hasattr(compat, n))
    assert not unknown, "names read through compat that it does not serve: " + ", ".join(unknown)
    assert not [p for p in compat.check() if p.startswith("mlx_lm.server.")]


def test_mlx_lm_modules_are_left_as_they_are():
    """The server's loops find mlxdist's batch generator and guarded
    factories as their own view of mlx-lm's names; mlx-lm's module keeps its
    own (it used to be changed for the whole process and never restored)."""
    import importlib

    import mlx_lm.server as lm_server

    from mlxdist.serving.isolation import guarded_factories
    from mlxdist.serving.lockstep import LockstepResponseGenerator
    from mlxdist.serving.server import generator_class

    factory = object()
    cls = generator_class({**guarded_factories(), "BatchGenerator": factory}, guarded_factories())
    assert cls._generate.__globals__["BatchGenerator"] is factory
    assert cls._generate.__globals__["_make_sampler"] is not compat.make_request_sampler
    single = super(LockstepResponseGenerator, cls)._serve_single  # what LockstepResponseGenerator's super() reaches
    assert single.__globals__["_make_logits_processors"] is not compat.make_request_processors
    assert lm_server.BatchGenerator is importlib.import_module("mlx_lm.generate").BatchGenerator
    assert lm_server._make_sampler is compat.make_request_sampler
    assert cls._generate.__code__ is lm_server.ResponseGenerator._generate.__code__


def test_loading_leaves_mlx_core_as_it_is(checkpoint):
    """Loading records sanitize's stacks on this thread for the call only."""
    import threading

    import mlx.core as mx

    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import load_lazy

    load, stack = mx.load, mx.stack
    path = checkpoint("mixtral")
    load_lazy(path, read_safetensors_index(path))
    assert mx.load is load and mx.stack is stack


def test_mlx_core_stays_as_it_is_during_a_load(checkpoint):
    """At every Python call of a load (sanitize's stacks among them), in the
    hub layout whose per-expert tensors sanitize stacks, mlx.core's load and
    stack are MLX's own, and the stacks are still recorded."""
    import sys

    import mlx.core as mx

    from mlxdist.model.checkpoint import find_switch_sites
    from mlxdist.ship.locate import read_safetensors_index
    from mlxdist.model.sources import load_lazy

    load, stack = mx.load, mx.stack
    swapped = []

    def watch(frame, event, arg):
        if mx.load is not load or mx.stack is not stack:
            swapped.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")

    path = checkpoint("mixtral", layout="hub")
    sys.setprofile(watch)
    try:
        model, _, sources = load_lazy(path, read_safetensors_index(path))
    finally:
        sys.setprofile(None)
    assert not swapped, f"mlx.core swapped during the load, first seen at {swapped[0]}"
    parts = [type(p).__name__ for site in find_switch_sites(model) for p in sources.expert_source(site)._parts]
    assert parts and set(parts) == {"_Each"}, parts


def test_the_command_lines_parse_before_mlx_lm_is_imported():
    """config.DEFAULT_MAX_TOKENS is mlx_lm.generate's, written out so that
    run and serve refuse a bad flag without importing mlx-lm (seconds)."""
    import subprocess
    import sys

    from mlx_lm.generate import DEFAULT_MAX_TOKENS

    from mlxdist.config import DEFAULT_MAX_TOKENS as ours

    assert ours == DEFAULT_MAX_TOKENS
    code = "import sys, mlxdist.cli.run, mlxdist.cli.serve; print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split() == ["[]"]
