"""Logical axes of every parameter, and the rules that map them onto a (data, fsdp, tensor) mesh
(`model/mesh.py`): the sharding rules live next to the weights, for the trainer and for decoding alike.

Parameters are named by logical axes (`embed`, `heads`, `mlp`, ...); `RULES` maps each to a mesh
axis (fsdp shards the embedding dimension of every weight, tensor shards heads / MLP / vocab).
A dimension that does not divide its mesh axis is an error, except `kv_heads`, which is replicated
when it cannot be split (Gemma's multi-query models have 1 KV head). Decode-layout weights
(`gemma.to_decode_layout`: `q_t`, ...) carry the same axes, out axes first.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pasta_jax.errors import ConfigError
from pasta_jax.model.gemma import DECODE_SUFFIX, PROJECTIONS
from pasta_jax.model.lora import A_SUFFIX, B_SUFFIX, IN_AXES, ROWS

# logical axis -> mesh axis (or axes, or None = replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
  "batch": ("data", "fsdp"),
  "length": None,
  "threads": None,
  "vocab": "tensor",
  "embed": "fsdp",
  "heads": "tensor",
  "kv_heads": "tensor",
  "head_dim": None,
  "mlp": "tensor",
  "norm": None,
  "lora_rank": None,  # adapters are small: the rank axis stays whole; their other axes follow the base
  "rows": None,
}
SOFT_AXES = frozenset({"kv_heads"})  # replicated instead of refused when not divisible

_LEAF_AXES = {
  "embedder": ("vocab", "embed"),
  "q": ("embed", "heads", "head_dim"),
  "k": ("embed", "kv_heads", "head_dim"),
  "v": ("embed", "kv_heads", "head_dim"),
  "o": ("heads", "head_dim", "embed"),
  "gate": ("embed", "mlp"),
  "up": ("embed", "mlp"),
  "down": ("mlp", "embed"),
  "scale": ("norm",),
  ROWS: ("rows", "embed"),
}
_LEAF_AXES.update({name + DECODE_SUFFIX: _LEAF_AXES[name][n_in:] + _LEAF_AXES[name][:n_in]
                   for name, n_in in PROJECTIONS.items()})  # the decode layout: [*out, *in]


def _leaf_axes(name: str) -> tuple[str, ...] | None:
  """Logical axes of a parameter by its name; a LoRA factor takes its projection's in or out axes."""
  for suffix in (A_SUFFIX, B_SUFFIX):
    proj = name[: -len(suffix)]
    if name.endswith(suffix) and proj in IN_AXES:
      base = _LEAF_AXES[proj]
      n_in = IN_AXES[proj]
      return base[:n_in] + ("lora_rank",) if suffix == A_SUFFIX else ("lora_rank",) + base[n_in:]
  return _LEAF_AXES.get(name)


def _path_names(path) -> list[str]:
  return [str(getattr(p, "key", getattr(p, "name", p))) for p in path]


def param_logical_axes(params) -> dict:
  """The params tree with each leaf replaced by its tuple of logical axis names."""

  def axes(path, leaf):
    logical = _leaf_axes(_path_names(path)[-1])
    if logical is None:
      raise ConfigError(f"no partitioning rule for parameter {'/'.join(_path_names(path))}")
    if len(logical) != len(np.shape(leaf)):
      raise ConfigError(f"parameter {'/'.join(_path_names(path))} has shape {np.shape(leaf)}, expected axes {logical}")
    return logical

  return jax.tree_util.tree_map_with_path(axes, params)


def mesh_axis_size(mesh_shape: dict[str, int], axis) -> int:
  """Devices along `axis` (a mesh axis name, a tuple of them, or None) of a mesh {name: size}."""
  if axis is None:
    return 1
  names = (axis,) if isinstance(axis, str) else axis
  return int(np.prod([mesh_shape[a] for a in names]))


def spec_for(shape: Sequence[int], logical: Sequence[str], mesh_shape: dict[str, int],
             where: str = "") -> PartitionSpec:
  """PartitionSpec of one array from its logical axes; raises ConfigError naming a dimension that does not divide."""
  out = []
  for dim, name in zip(shape, logical, strict=True):
    axis = RULES[name]
    size = mesh_axis_size(mesh_shape, axis)
    if size > 1 and dim % size:
      if name in SOFT_AXES:
        axis = None
      else:
        raise ConfigError(f"{where or 'array'}: dimension {name}={dim} does not divide over mesh axis "
                          f"{axis} of size {size} (mesh {mesh_shape})")
    out.append(axis if size > 1 else None)
  return PartitionSpec(*out)


def param_specs(params, mesh_shape: dict[str, int]) -> dict:
  """PartitionSpec per parameter (params may be arrays or jax.ShapeDtypeStruct)."""
  logical = param_logical_axes(params)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf, axes: spec_for(np.shape(leaf), axes, mesh_shape, "/".join(_path_names(path))),
      params, logical, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))


def param_shardings(params, mesh: Mesh) -> dict:
  specs = param_specs(params, dict(mesh.shape))
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec(ndim: int) -> PartitionSpec:
  """Batch arrays shard their leading (example) dimension over data x fsdp; the rest is replicated."""
  return PartitionSpec(RULES["batch"], *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(ndim))


def gather_to_host(tree):
  """Every leaf whole on this host (numpy). Arrays that span several processes are gathered from all of them: a
  collective, so every process must call it, even one that then discards the result."""
  if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)
