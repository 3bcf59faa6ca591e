"""MLX arrays as numpy views of their bits and back (bfloat16, which numpy
lacks, as uint16): what checkpoint reads and the p2p wire format share."""

import mlx.core as mx
import numpy as np


def to_numpy(a: mx.array) -> np.ndarray:
    """The array's bits as numpy (bfloat16 as uint16)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """Inverse of ``to_numpy``."""
    out = mx.array(a)
    return out.view(dtype) if dtype == mx.bfloat16 else out
