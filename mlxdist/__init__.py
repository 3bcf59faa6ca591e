"""mlxdist: expert-parallel Mixture-of-Experts inference on MLX over MPI."""

__version__ = "0.1.0"
