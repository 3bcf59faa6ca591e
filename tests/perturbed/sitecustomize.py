"""Test-only: one rank whose logits differ from the others', as a rank of
another GPU generation's may (tests/test_token_stream.py puts this folder
first on that job's PYTHONPATH).

    MLXDIST_TEST_PERTURB="module=qwen3_moe,rank=1,noise=1.0,eos=3,eos_at=4"

On that rank (mpirun's or mlx.launch's rank), mlx-lm's ``models.<module>.Model``
returns its logits plus noise of that scale, drawn from keys of its own (the
global random state, which sampling reads, is left alone); from its
``eos_at``-th call on, the last position's logit of token ``eos`` is raised
far above the rest, so that rank alone would sample end-of-sequence there.
"""

import importlib
import os

_SPEC = os.environ.get("MLXDIST_TEST_PERTURB")
_RANK = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("MLX_RANK"))


def _perturb(spec: str) -> None:
    import mlx.core as mx

    values = dict(p.split("=", 1) for p in spec.split(",") if p)
    model_class = importlib.import_module(f"mlx_lm.models.{values['module']}").Model
    noise, eos, eos_at = float(values.get("noise", 0)), values.get("eos"), int(values.get("eos_at", 0))
    forward = model_class.__call__
    calls = [0]

    def perturbed(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)  # [B, L, V]
        calls[0] += 1
        if noise:
            logits = logits + noise * mx.random.normal(logits.shape, key=mx.random.key(calls[0])).astype(logits.dtype)
        if eos is not None and eos_at and calls[0] >= eos_at:
            raised = mx.zeros((logits.shape[-1],), logits.dtype).at[int(eos)].add(1e4)
            logits = mx.concatenate([logits[:, :-1], logits[:, -1:] + raised], axis=1)
        return logits

    model_class.__call__ = perturbed


if _SPEC and _RANK is not None and dict(p.split("=", 1) for p in _SPEC.split(",") if p).get("rank") == _RANK:
    _perturb(_SPEC)
