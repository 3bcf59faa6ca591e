"""What one rank holds after LOAD, and how it takes part in a generation.

Loading: mlx-lm builds the model lazily; each MoE layer's expert module is
replaced by a ``DistributedSwitch`` holding this rank's experts; then only
what this rank runs is evaluated (read from disk). Generation reuses
mlx-lm's ``stream_generate`` (prefill in chunks, KV caches, samplers,
detokenizers) on every rank that runs the dense model.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchResponse, GenerationResponse, batch_generate, stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer

from . import __version__
from .commands import PROTOCOL_VERSION
from .dispatch import ExpertShard, make_dispatcher, serve_experts
from .loader import find_switch_sites, nbytes, read_safetensors_index, slice_experts
from .moe import DistributedSwitch
from .mpi import World
from .placement import Placement, resolve_placement


class UserError(Exception):
    """A problem with the user's input: reported in one line, no traceback."""


def resolve_model_path(model: str) -> Path:
    """A local folder, or a hub id fetched into the hub cache."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json: not an mlx-lm model folder")
        return path
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise UserError(f"model path {model} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                model,
                allow_patterns=["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot fetch {model!r} from the Hugging Face hub: {reason}") from None


@dataclass
class SamplingParams:
    """What GENERATE carries besides the prompt; validated on rank 0."""

    max_tokens: int = 64
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    prefill_step_size: int = 2048

    def validate(self) -> None:
        if not self.max_tokens >= 1:
            raise UserError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temp >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.top_k >= 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.prefill_step_size >= 1:
            raise UserError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")

    def sampler(self):
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)


@dataclass
class Engine:
    """A loaded model on one rank.

    ``model`` is None on p2p workers, which hold ``experts`` only.
    """

    world: World
    dispatch: str
    placement: Placement
    config: Dict[str, Any]
    model: Optional[nn.Module]
    tokenizer: Any
    experts: Dict[int, nn.Module]
    shards: Dict[int, ExpertShard]
    dispatcher: Any
    memory: Dict[str, int] = field(default_factory=dict)
    memory_by_rank: List[Dict[str, int]] = field(default_factory=list)
    fingerprint: Dict[str, Any] = field(default_factory=dict)

    @property
    def runs_dense(self) -> bool:
        return self.model is not None

    @property
    def context_length(self) -> Optional[int]:
        cfg = self.config.get("text_config", self.config)
        return cfg.get("max_position_embeddings")

    def generate(self, prompt: List[int], params: SamplingParams) -> Iterator[GenerationResponse]:
        """mlx-lm's ``stream_generate`` through the distributed experts.

        Called on every rank that runs the dense model (all ranks in the
        collective mode, rank 0 in p2p): each takes identical decisions
        because each sees identical logits and the same seed.
        """
        mx.random.seed(params.seed if params.seed is not None else 0)
        try:
            yield from stream_generate(
                self.model,
                self.tokenizer,
                mx.array(prompt),
                max_tokens=params.max_tokens,
                sampler=params.sampler(),
                prefill_step_size=params.prefill_step_size,
            )
        finally:
            self.dispatcher.finish()

    def generate_batch(self, prompts: List[List[int]], params: SamplingParams) -> BatchResponse:
        """mlx-lm's ``batch_generate`` (left-padded batches, finished
        sequences leave the batch) through the distributed experts."""
        mx.random.seed(params.seed if params.seed is not None else 0)
        try:
            return batch_generate(
                self.model,
                self.tokenizer,
                prompts,
                max_tokens=params.max_tokens,
                sampler=params.sampler(),
                prefill_step_size=params.prefill_step_size,
                completion_batch_size=max(len(prompts), 1),
                prefill_batch_size=max(len(prompts), 1),
                return_token_ids=True,
            )
        finally:
            self.dispatcher.finish()

    def serve(self) -> None:
        """A p2p worker's part in one generation."""
        serve_experts(self.world, self.experts, self.shards, self.dispatcher.stats)


def load_engine(
    world: World,
    model: str,
    dispatch: str = "collective",
    placement: Optional[dict] = None,
    rank0_experts: bool = True,
) -> Engine:
    """Build this rank's part of the model (see the module's docstring)."""
    path = resolve_model_path(model)
    _check_config(path)
    index = read_safetensors_index(path)
    try:
        lazy_model, config = load_model(path, lazy=True)
    except (ValueError, FileNotFoundError, OSError, KeyError, TypeError) as e:
        raise UserError(f"cannot load {path}: {str(e).splitlines()[0]}") from None
    sites = find_switch_sites(lazy_model)
    if not sites:
        raise UserError(
            f"{path} ({config.get('model_type')}) has no MoE layers with "
            f"SwitchGLU/SwitchMLP experts: nothing to distribute"
        )
    experts_per_layer = {s.layer: s.num_experts for s in sites}
    plan = resolve_placement(placement, experts_per_layer, world.size, rank0_experts)
    dispatcher = make_dispatcher(dispatch, world)
    runs_dense = dispatch != "p2p" or world.is_root
    if dispatch == "collective-tp" and world.size > 1:
        _shard_dense(lazy_model, sites, world, config)

    experts, shards = {}, {}
    for site in sites:
        shard = ExpertShard.build(site.layer, plan.layers[site.layer], world.rank)
        shards[site.layer] = shard
        owned = shard.owned
        local = slice_experts(site, owned, index) if owned else None
        if local is not None:
            mx.eval(local.parameters())
            experts[site.layer] = local
        first = site is sites[0]
        setattr(site.parent, site.attr, DistributedSwitch(shard, local, dispatcher, first))

    expert_bytes = sum(nbytes(e.parameters()) for e in experts.values())
    tokenizer = None
    if runs_dense:
        mx.eval(lazy_model.parameters())
        try:
            tokenizer = load_tokenizer(path)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"cannot load the tokenizer in {path} (tokenizer.json): {reason}") from None
        dense_bytes = nbytes(lazy_model.parameters()) - expert_bytes
    else:
        lazy_model, dense_bytes = None, 0
    fingerprint = {
        "mlxdist": __version__,
        "protocol": PROTOCOL_VERSION,
        "config": _digest((path / "config.json").read_bytes()),
        "weights": _digest(json.dumps(sorted((k, e.dtype, e.shape) for k, e in index.items())).encode()),
        "placement": _digest(json.dumps(plan.to_json(), sort_keys=True).encode()),
    }
    return Engine(
        world,
        dispatch,
        plan,
        config,
        lazy_model,
        tokenizer,
        experts,
        shards,
        dispatcher,
        memory={"expert_bytes": expert_bytes, "dense_bytes": dense_bytes},
        fingerprint=fingerprint,
    )


def _shard_dense(model: nn.Module, sites, world: World, config: Dict[str, Any]) -> None:
    """mlx-lm's own tensor parallelism for everything but the routed experts:
    ``shard()`` splits attention, dense and shared-expert layers (and makes
    each MoE block sum its output over the ranks); the routed experts keep
    their full, unsharded parameters for expert parallelism."""
    if not hasattr(model, "shard"):
        raise UserError(
            f"{config.get('model_type')} has no tensor-parallel shard() in mlx-lm: "
            f"use --dispatch collective or p2p"
        )
    cfg = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = cfg.get(key)
        if heads is not None and heads % world.size:
            raise UserError(f"{key} = {heads} does not split over {world.size} ranks")
    full = [site.module.parameters() for site in sites]
    model.shard(world.group)
    for site, params in zip(sites, full):
        site.module.update(params)


def _check_config(path: Path) -> None:
    try:
        json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path / 'config.json'} is not valid JSON ({e})") from None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
