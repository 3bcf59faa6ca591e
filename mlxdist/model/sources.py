"""Where each MoE layer's stacked expert tensors come from in the checkpoint,
for every layout mlx-lm loads, so that a rank reads only the experts it owns
and builds them as mlx-lm's ``sanitize`` would (``ExpertSource``):

- mlx-lm's layout (the stacked tensor stored under the module's name and
  shape): its owned rows, read at their byte offsets;
- per-expert tensors (the layout most models ship, which ``sanitize`` stacks
  with one ``mx.stack``; ``load_lazy`` records each stack's inputs): the owned
  experts' tensors, and nothing of the others;
- fused tensors with a leading expert axis under another name (gpt-oss's
  ``gate_up_proj_blocks``, which ``sanitize`` views, splits and renames): the
  owned rows of the source tensor, one expert at a time, run through the
  model's own ``sanitize``; which source gives which tensor is found by
  running ``sanitize`` on an empty cut of each candidate (nothing is read);
- anything else: the lazy stacked tensor sliced, which reads it whole.

Owned experts are copied one at a time into one buffer per tensor, so that a
load peaks at what the rank keeps. Paging (``model/paging.py``) reads single
experts again through the same ``ExpertSource``.
"""

import inspect
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlxdist.values.arrays import from_numpy, to_numpy
from mlxdist.errors import CheckpointError
from mlxdist.model.checkpoint import SwitchSite, entry_dtype, read_rows, read_stacked, stacked_tensors
from mlxdist.ship.locate import TensorEntry
from mlxdist.ship.unreceived import refuse_unheld

_NUMPY = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.uint32: np.uint32,
          mx.int32: np.int32, mx.uint8: np.uint8, mx.int8: np.int8, mx.int64: np.int64, mx.uint16: np.uint16}
Sanitize = Callable[[Dict[str, mx.array]], Dict[str, mx.array]]


def load_experts(site: SwitchSite, source: "ExpertSource", expert_ids: List[int]) -> nn.Module:
    """The site's expert module holding the experts ``expert_ids``, in order, read from ``source``."""
    # The lazy stacked tensors go first: their graphs would keep what the reads evaluate.
    site.module.update(tree_unflatten([(name, mx.zeros((0,))) for name in source.names]))
    site.module.update(tree_unflatten(source.read(expert_ids)))
    return site.module


@dataclass
class _Stack:
    """One ``mx.stack`` that ``sanitize`` ran: its result, its lazy inputs,
    and per input the checkpoint tensor it was loaded as (None where
    ``sanitize`` computed it)."""

    result: mx.array
    inputs: List[mx.array]
    names: List[Optional[str]]


class CheckpointSources:
    """Where each MoE layer's stacked expert tensors come from in the
    checkpoint (see the module's docstring): the safetensors index, the
    stacks mlx-lm's ``sanitize`` made while loading, and ``sanitize`` itself."""

    def __init__(self, index: Dict[str, TensorEntry], stacks: Optional[Dict[int, _Stack]] = None,
                 sanitize: Optional[Sanitize] = None):
        self.index = index
        self._stacks = stacks or {}
        self._stacked_names = {n for s in self._stacks.values() for n in s.names}
        self._sanitize = sanitize
        self._fused: Dict[int, Dict[str, Tuple[str, Tuple[int, ...], mx.Dtype]]] = {}

    def expert_source(self, site: SwitchSite) -> "ExpertSource":
        """How to read any of the site's experts (its stacks' records are used up)."""
        experts, parts, fused = site.num_experts, [], {}
        for name, value, entry in stacked_tensors(site, self.index):
            stack = self._stacks.pop(id(value), None)
            if stack is not None and (stack.result is not value or len(stack.names) != experts):
                stack = None
            cut = self._fused_outputs(experts).get(f"{site.path}.{name}") if entry is None and stack is None else None
            if entry is not None:
                parts.append(_Rows(name, entry))
            elif stack is not None:
                entries = [self.index.get(n) if n is not None else None for n in stack.names]
                if all(_matches(e, value.shape[1:], value.dtype) for e in entries):
                    parts.append(_Each(name, entries))
                else:
                    parts.append(_Inputs(name, stack.inputs))
            elif cut is not None and cut[1:] == (tuple(value.shape[1:]), value.dtype):
                if cut[0] not in fused:  # gate and up from one source: read it once
                    fused[cut[0]] = _Fused({}, cut[0], self.index[cut[0]], self._sanitize)
                    parts.append(fused[cut[0]])
                fused[cut[0]].outputs[f"{site.path}.{name}"] = name
            else:
                parts.append(_Whole(name, value))
        return ExpertSource(parts)

    def stored_experts(self, site: SwitchSite) -> List[Tuple[TensorEntry, Optional[int]]]:
        """The stored tensors ``expert_source`` reads the site's experts from,
        using nothing up: (entry, expert) for a tensor of one expert, (entry,
        None) for one whose rows are the experts. Experts that ``sanitize``
        computes from other tensors are not here (``ship/share_needs.py``
        finds them by name)."""
        experts, out = site.num_experts, []
        for name, value, entry in stacked_tensors(site, self.index):
            stack = self._stacks.get(id(value))
            cut = self._fused_outputs(experts).get(f"{site.path}.{name}") if entry is None and stack is None else None
            if entry is not None:
                out.append((entry, None))
            elif stack is not None and stack.result is value and len(stack.names) == experts:
                out += [(self.index[n], e) for e, n in enumerate(stack.names) if n in self.index]
            elif cut is not None:
                out.append((self.index[cut[0]], None))
        return out

    def _fused_outputs(self, experts: int) -> Dict[str, Tuple[str, Tuple[int, ...], mx.Dtype]]:
        """Sanitized name -> (the source tensor it is cut from, shape of one
        expert's part, dtype), over every stored tensor with a leading axis of
        ``experts`` that no stack used: each run alone through ``sanitize``
        with none of its rows (nothing is read)."""
        if self._sanitize is None:
            return {}
        if experts not in self._fused:
            found = {}
            for source, entry in self.index.items():
                dtype = entry_dtype(entry)
                if len(entry.shape) < 2 or entry.shape[0] != experts or source in self._stacked_names or dtype is None:
                    continue
                empty = mx.zeros((0,) + entry.shape[1:], dtype=dtype)
                try:
                    produced = self._sanitize({source: empty})
                except Exception:  # needs other tensors with it: not a cut of one source
                    continue
                for name, v in produced.items():
                    if isinstance(v, mx.array) and v.ndim and v.shape[0] == 0:
                        found[name] = (source, tuple(v.shape[1:]), v.dtype)
            self._fused[experts] = found
        return self._fused[experts]


def as_sources(sources: Union[CheckpointSources, Dict[str, TensorEntry]]) -> CheckpointSources:
    return sources if isinstance(sources, CheckpointSources) else CheckpointSources(sources)


def slice_experts(site: SwitchSite, expert_ids: List[int], sources) -> nn.Module:
    """The site's expert module holding only the experts ``expert_ids``, in
    order, read from ``sources`` (``CheckpointSources``, or a plain index,
    which reads mlx-lm's layout by offset and slices any other). Only the
    stacked projections' tensors are sliced (those whose first dimension is
    the experts); anything else the module holds stays whole."""
    return load_experts(site, as_sources(sources).expert_source(site), expert_ids)


def load_lazy(path: Path, index: Dict[str, TensorEntry]) -> Tuple[nn.Module, Dict[str, Any], CheckpointSources]:
    """``mlx_lm.utils.load_model(path, lazy=True)``, recording each
    ``mx.stack`` its ``sanitize`` runs and the name each tensor was loaded
    as, so that a stacked expert tensor can be rebuilt from its owned
    experts' inputs alone. From a share, a tensor it does not hold whole
    fails when evaluated (``ship/unreceived.py``).

    A lazy array does not tell its inputs, so the stacks are recorded where
    they are made: mlx-lm builds the model through ``get_model_classes``,
    and on the model it builds (and on each of its modules with a
    ``sanitize`` of its own, which a model's ``sanitize`` may hand the
    weights on to) ``sanitize`` is, for the load only, a copy of the class's
    that finds a recording ``mlx.core`` in its module's names
    (``compat.with_module_names``). mlx-lm's modules and ``mlx.core`` are
    left as they are. A stack made where that copy does not reach (a
    parent class's ``sanitize`` called through ``super()`` or the class, a
    function of another module) is not recorded: its tensor is read whole."""
    from mlx_lm.utils import load_model

    from mlxdist.compat import model_classes

    recorder = _StackRecorder()
    loaded: Dict[int, Tuple[str, mx.array]] = {}
    built: List[nn.Module] = []

    def refuse_and_sanitize(sanitize: Optional[Callable]) -> Sanitize:
        def load_and_sanitize(weights):
            by_file: Dict[Path, Dict[str, mx.array]] = {}
            for name, value in weights.items():
                entry = index.get(name)
                if entry is not None:
                    by_file.setdefault(entry.file, {})[name] = value
            for file, arrays in by_file.items():  # a share's tensors it lacks fail when read
                weights.update(refuse_unheld(file, arrays))
            loaded.update((id(v), (k, v)) for k, v in weights.items())
            return sanitize(weights) if sanitize is not None else weights

        return load_and_sanitize

    def classes(config):
        model_class, args_class = model_classes(config)

        def build(args):
            model = model_class(args)
            built.append(model)
            for module in [m for m in model.modules() if m is not model]:
                if _recordable(module):
                    module.sanitize = _recording(module, recorder)
            own = _recording(model, recorder) if _recordable(model) else getattr(model, "sanitize", None)
            model.sanitize = refuse_and_sanitize(own)  # load_model calls it, the model having one or not
            return model

        return build, args_class

    try:
        model, config = load_model(path, lazy=True, get_model_classes=classes)
    finally:
        for m in built:
            for module in m.modules():
                if "sanitize" in vars(module):
                    del module.sanitize
    stacks = {}
    for result, inputs in recorder.made:  # every loaded array is still alive here: ids are not reused
        names = [loaded[id(x)][0] if id(x) in loaded and loaded[id(x)][1] is x else None for x in inputs]
        stacks[id(result)] = _Stack(result, inputs, names)
    return model, config, CheckpointSources(index, stacks, getattr(model, "sanitize", None))


class _StackRecorder:
    """``mlx.core`` as a model's ``sanitize`` sees it during a load: each
    stack along the first axis is recorded (its result and inputs)."""

    def __init__(self):
        self.made: List[Tuple[mx.array, List[mx.array]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def stack(self, arrays, *args, **kwargs) -> mx.array:
        arrays = list(arrays)
        out = mx.stack(arrays, *args, **kwargs)
        if not args and kwargs.get("axis", 0) == 0:
            self.made.append((out, arrays))
        return out


def _recordable(module: nn.Module) -> bool:
    """Whether the module's class has a plain ``sanitize`` method."""
    return inspect.isfunction(inspect.getattr_static(type(module), "sanitize", None))


def _recording(module: nn.Module, recorder: _StackRecorder) -> Sanitize:
    """The module's ``sanitize``, bound to it, finding ``recorder`` wherever its module names ``mlx.core``."""
    from mlxdist.compat import with_module_names

    func = inspect.getattr_static(type(module), "sanitize")
    names = {k: recorder for k, v in func.__globals__.items() if v is mx}
    return types.MethodType(with_module_names(func, names), module)


class ExpertSource:
    """One MoE layer's stacked expert tensors and where each comes from."""

    def __init__(self, parts: List["_Part"]):
        self._parts = parts
        self.names = [n for p in parts for n in p.names]

    @property
    def unpageable(self) -> Optional[str]:
        """The first tensor that cannot be read again expert by expert, if any."""
        return next((p.names[0] for p in self._parts if not p.pageable), None)

    def read(self, expert_ids: List[int]) -> List[Tuple[str, mx.array]]:
        """Each stacked tensor's rows ``expert_ids``, in order: ``[len(ids), ...]``."""
        out = {}
        for part in self._parts:
            out.update(part.read(expert_ids))
        return [(name, out[name]) for name in self.names]


@dataclass
class _Rows:  # mlx-lm's layout: the stored stacked tensor's rows
    name: str
    entry: TensorEntry
    pageable = True

    @property
    def names(self) -> List[str]:
        return [self.name]

    def read(self, ids: List[int]) -> Dict[str, mx.array]:
        return {self.name: read_rows(self.entry, ids)}


@dataclass
class _Each:  # one stored tensor per expert
    name: str
    entries: List[TensorEntry]
    pageable = True

    @property
    def names(self) -> List[str]:
        return [self.name]

    def read(self, ids: List[int]) -> Dict[str, mx.array]:
        return {self.name: read_stacked([self.entries[i] for i in ids])}


@dataclass
class _Fused:  # a stored tensor with a leading expert axis under another name: its rows, through sanitize
    outputs: Dict[str, str]  # name after sanitize -> name in the module
    source: str
    entry: TensorEntry
    sanitize: Sanitize
    pageable = True

    @property
    def names(self) -> List[str]:
        return list(self.outputs.values())

    def read(self, ids: List[int]) -> Dict[str, mx.array]:
        def chunks():  # one expert at a time: its source rows and sanitize's outputs are all it holds twice
            for i in ids:
                produced = self.sanitize({self.source: read_rows(self.entry, [i])})
                yield {name: produced[output] for output, name in self.outputs.items()}

        return _concatenate(chunks(), len(ids))


@dataclass
class _Inputs:  # per-expert tensors sanitize computes (dequantizes, ...): their lazy arrays, once
    name: str
    inputs: List[Optional[mx.array]]
    pageable = False

    @property
    def names(self) -> List[str]:
        return [self.name]

    def read(self, ids: List[int]) -> Dict[str, mx.array]:
        inputs, self.inputs = self.inputs, []
        if not inputs:
            raise CheckpointError(f"the experts of {self.name} were read already")

        def chunks():
            for i in ids:
                x, inputs[i] = inputs[i], None  # nothing keeps an expert once it is copied
                yield {self.name: x[None]}

        return _concatenate(chunks(), len(ids))


@dataclass
class _Whole:  # the lazy stacked tensor, sliced: reads it whole
    name: str
    value: mx.array
    pageable = False

    @property
    def names(self) -> List[str]:
        return [self.name]

    def read(self, ids: List[int]) -> Dict[str, mx.array]:
        return {self.name: self.value[mx.array(ids, dtype=mx.int32)]}


_Part = Union[_Rows, _Each, _Fused, _Inputs, _Whole]


def _concatenate(chunks, rows: int) -> Dict[str, mx.array]:
    """Chunks (name -> ``[n_i, ...]``) evaluated one at a time and copied
    into one buffer per name, so that no more than a chunk is held twice
    (dtypes numpy lacks, the float8 kinds, are concatenated in MLX)."""
    buffers: Dict[str, np.ndarray] = {}
    dtypes: Dict[str, mx.Dtype] = {}
    pending: Dict[str, List[mx.array]] = {}
    at = 0
    for chunk in chunks:
        mx.eval(list(chunk.values()))
        for name, v in chunk.items():
            if v.dtype not in _NUMPY:
                pending.setdefault(name, []).append(v)
                continue
            if name not in buffers:
                buffers[name] = np.empty((rows,) + tuple(v.shape[1:]), dtype=_NUMPY[v.dtype])
                dtypes[name] = v.dtype
            buffers[name][at:at + v.shape[0]] = to_numpy(v)
        at += next(iter(chunk.values())).shape[0]
        del chunk
    if at != rows:
        raise CheckpointError(f"read {at} experts' rows where {rows} were asked for")
    out = {name: from_numpy(b, dtypes[name]) for name, b in buffers.items()}
    out.update((name, mx.concatenate(parts)) for name, parts in pending.items())
    return out


def _matches(entry: Optional[TensorEntry], shape, dtype: mx.Dtype) -> bool:
    return entry is not None and entry.shape == tuple(shape) and entry_dtype(entry) == dtype
