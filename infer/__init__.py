"""Inference entry points, beside `train/`: thin commands over `pasta_jax` (the `pasta` CLI calls the same)."""
