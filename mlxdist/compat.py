"""Every private name of mlx-lm that mlxdist uses, in one place.

mlx-lm promises nothing about its underscored names, and a release may
rename one or change its arguments. So mlxdist imports them from here only
(``tests/test_compat.py`` fails where a module imports one elsewhere), and
``check()`` (run by that test) names each one a release no longer has as
mlxdist uses it. The functions are re-exported under plain names; the
members mlxdist's subclasses override, call or read are listed in
``MEMBERS`` with the parameters mlxdist passes.

``mlx_lm.server`` is an application, not a library: none of its names,
public or private, is promised. Every one mlxdist's server uses is served
from here (``SERVER``, as ``compat.<name>``) and ``check()`` finds each, so
no other module imports ``mlx_lm.server``.

``with_globals`` gives one mlx-lm function its own view of the names it
looks up in its module, instead of replacing them in the module for every
caller (see ``serving/server.py``): the function must look those names up
(``GLOBALS_READ``). The copy shares the function's code and reads a snapshot
of its module's names taken when it is made, with the given names over them:
a name the module rebinds later is not seen by the copy. ``with_module_names``
is the same copy, unchecked, for a model's ``sanitize`` during a load
(``model/sources.py`` gives it a recording ``mlx.core``).
"""

import dataclasses
import importlib
import inspect
import re
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from mlx_lm.generate import _extend_cache as extend_cache  # noqa: F401 - merges two batches' KV caches
from mlx_lm.utils import _download as download  # noqa: F401 - a hub id to a local directory
from mlx_lm.utils import _get_classes as model_classes  # noqa: F401 - config -> (Model, ModelArgs)

# Every name of mlx-lm's server that mlxdist uses: mlxdist's name -> the server's. The module
# is imported on the first use of one (it is large).
SERVER: Dict[str, str] = {
    "make_request_sampler": "_make_sampler",  # a request's sampler
    "make_request_processors": "_make_logits_processors",  # a request's logits processors
    "APIHandler": "APIHandler",  # the HTTP handler mlxdist's serving/http.py subclasses
    "ModelProvider": "ModelProvider",
    "ResponseGenerator": "ResponseGenerator",
    "GenerationContext": "GenerationContext",
    "GenerationArguments": "GenerationArguments",
    "ModelDescription": "ModelDescription",
    "SamplingArguments": "SamplingArguments",
    "LogitsProcessorArguments": "LogitsProcessorArguments",
    "TextStateMachine": "TextStateMachine",  # the answer's text split into normal, reasoning and tool
    "make_text_state_machine": "make_text_state_machine",
    "ToolCallFormatter": "ToolCallFormatter",
    "CompletionRequest": "CompletionRequest",
    "Response": "Response",
    "TimeBudget": "TimeBudget",
    "get_system_fingerprint": "get_system_fingerprint",
    "process_message_content": "process_message_content",
}


def __getattr__(name: str) -> Any:
    if name in SERVER:
        from mlx_lm import server

        return getattr(server, SERVER[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The module functions above and in _SERVER: (module, private name, the parameters mlxdist passes).
FUNCTIONS: List[Tuple[str, str, Tuple[str, ...]]] = [
    ("mlx_lm.generate", "_extend_cache", ("cache_a", "cache_b")),
    ("mlx_lm.server", "_make_sampler", ("args", "tokenizer")),
    ("mlx_lm.server", "_make_logits_processors", ("args",)),
    ("mlx_lm.utils", "_download", ("path_or_hf_repo",)),
    ("mlx_lm.utils", "_get_classes", ("config",)),
]

# Members of mlx-lm classes that mlxdist overrides, calls or reads: (module,
# class, private name, the parameters mlxdist passes, or None for an
# attribute the class sets on its instances).
MEMBERS: List[Tuple[str, str, str, Optional[Tuple[str, ...]]]] = [
    ("mlx_lm.server", "ResponseGenerator", "_generate", ("self",)),
    ("mlx_lm.server", "ResponseGenerator", "_run_generate", ("self",)),
    ("mlx_lm.server", "ResponseGenerator", "_share_object", ("self", "obj")),
    ("mlx_lm.server", "ResponseGenerator", "_share_request", ("self", "request")),
    ("mlx_lm.server", "ResponseGenerator", "_tokenize", ("self", "tokenizer", "request", "args")),
    ("mlx_lm.server", "ResponseGenerator", "_make_state_machine", ("self", "model_key", "tokenizer", "stop_words")),
    ("mlx_lm.server", "ResponseGenerator", "_serve_single", ("self", "request", "stream")),
    ("mlx_lm.server", "ResponseGenerator", "_stop", None),
    ("mlx_lm.server", "ResponseGenerator", "_time_budget", None),
    ("mlx_lm.server", "ResponseGenerator", "_generation_thread", None),
    ("mlx_lm.server", "ModelProvider", "_load", ("self", "model_path", "adapter_path", "draft_model_path")),
    ("mlx_lm.server", "APIHandler", "_set_cors_headers", ("self",)),
    ("mlx_lm.server", "APIHandler", "_set_completion_headers", ("self", "status_code")),
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper", "_detokenizer", None),
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper", "_eos_token_ids", None),
]

# Names a function must look up in its module for ``with_globals`` to give it others.
GLOBALS_READ: List[Tuple[str, str, Tuple[str, ...]]] = [
    ("mlx_lm.server", "ResponseGenerator._generate", ("BatchGenerator", "_make_sampler", "_make_logits_processors")),
    ("mlx_lm.server", "ResponseGenerator._serve_single", ("_make_sampler", "_make_logits_processors")),
]


def never_stop_at_eos(tokenizer: Any) -> None:
    """A ``TokenizerWrapper`` that reports no end-of-sequence token (as
    ``mlx_lm.benchmark`` does): every generation runs its full length."""
    tokenizer._eos_token_ids = set()


def set_detokenizer(tokenizer: Any, detokenizer: Any) -> None:
    """The streaming detokenizer a ``TokenizerWrapper`` copies for each caller."""
    tokenizer._detokenizer = detokenizer


def with_globals(func: Callable, **names: Any) -> Callable:
    """A copy of ``func`` that finds ``names`` where it looks them up in its
    module's globals (the module itself is left as it is)."""
    missing = sorted(set(names) - set(func.__code__.co_names))
    if missing:
        raise RuntimeError(f"mlx-lm's {func.__qualname__} no longer looks up {', '.join(missing)}: "
                           f"mlxdist cannot give it its own (mlxdist/compat.py)")
    return with_module_names(func, names)


def with_module_names(func: Callable, names: Dict[str, Any]) -> Callable:
    """A copy of ``func`` (an mlx-lm model's ``sanitize``) that finds
    ``names`` where it, or a function it defines while it runs, looks them up
    in its module's globals; the module itself is left as it is. Unlike
    ``with_globals`` nothing is checked: mlxdist lists no lookups of a
    model's code, and a name the function does not look up changes nothing."""
    view = {**func.__globals__, **names}
    copy = types.FunctionType(func.__code__, view, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = func.__kwdefaults__, func.__qualname__, func.__doc__
    return copy


def check() -> List[str]:
    """What this mlx-lm no longer has as mlxdist uses it, one line each ([] where all is well)."""
    problems = []
    server = importlib.import_module("mlx_lm.server")
    problems += [f"mlx_lm.server.{name} is gone" for name in SERVER.values() if not hasattr(server, name)]
    for module, name, params in FUNCTIONS:
        found = getattr(importlib.import_module(module), name, None)
        problems += _check_params(f"{module}.{name}", found, params)
    for module, cls_name, name, params in MEMBERS:
        where = f"{module}.{cls_name}.{name}"
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is None:
            problems.append(f"{module}.{cls_name} is gone")
        elif params is not None:
            problems += _check_params(where, getattr(cls, name, None), params)
        elif not _sets_attribute(cls, name):
            problems.append(f"{where}: the class no longer sets this attribute")
    for module, qualname, names in GLOBALS_READ:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        missing = sorted(set(names) - set(getattr(getattr(obj, "__code__", None), "co_names", ())))
        if missing:
            problems.append(f"{module}.{qualname} no longer looks up {', '.join(missing)} in its module")
    return problems


def _check_params(where: str, func: Optional[Callable], params: Tuple[str, ...]) -> List[str]:
    if func is None:
        return [f"{where} is gone"]
    try:
        have = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return [f"{where} has no signature to check"]
    if have[: len(params)] != list(params):
        return [f"{where} takes ({', '.join(have)}), mlxdist passes ({', '.join(params)})"]
    return []


def _sets_attribute(cls: type, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{re.escape(name)}\s*[:=]", source) is not None
