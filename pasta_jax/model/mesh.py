"""The (data, fsdp, tensor) device mesh that the partition rules (`model/partitioning.py`) place weights on:
its shape, read from "data,fsdp,tensor" text, and the jax Mesh over the devices at hand. Training and
decoding build theirs here alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pasta_jax.errors import ConfigError

AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape. data x fsdp x tensor must equal the number of devices used."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def shape(self) -> dict[str, int]:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


def parse_mesh(text: str) -> MeshConfig:
  """"data,fsdp,tensor" text (a --mesh flag, e.g. "1,4,2") -> its shape."""
  try:
    data, fsdp, tensor = (int(x) for x in text.split(","))
  except ValueError:
    raise ConfigError(f"--mesh {text!r}: expected three integers data,fsdp,tensor") from None
  return MeshConfig(data, fsdp, tensor)


def make_mesh(shape: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all), refusing a shape that does not match."""
  devices = list(jax.devices() if devices is None else devices)
  if shape.size != len(devices):
    raise ConfigError(f"mesh data x fsdp x tensor = {shape.data} x {shape.fsdp} x {shape.tensor} = {shape.size} "
                      f"devices, but {len(devices)} are available ({devices[0].platform})")
  grid = np.asarray(devices, dtype=object).reshape(shape.data, shape.fsdp, shape.tensor)
  return Mesh(grid, AXES)
