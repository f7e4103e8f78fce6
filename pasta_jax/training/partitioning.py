"""The trainer's mesh; the sharding rules themselves live with the weights (`model/partitioning.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pasta_jax.errors import ConfigError
from pasta_jax.model.partitioning import (  # noqa: F401
  AXES,
  RULES,
  batch_sharding,
  batch_spec,
  param_logical_axes,
  param_shardings,
  param_specs,
  spec_for,
)
from pasta_jax.training.config import MeshConfig


def make_mesh(shape: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all), refusing a shape that does not match."""
  devices = list(jax.devices() if devices is None else devices)
  if shape.size != len(devices):
    raise ConfigError(f"mesh data x fsdp x tensor = {shape.data} x {shape.fsdp} x {shape.tensor} = {shape.size} "
                      f"devices, but {len(devices)} are available ({devices[0].platform})")
  grid = np.asarray(devices, dtype=object).reshape(shape.data, shape.fsdp, shape.tensor)
  return Mesh(grid, AXES)
