"""Multi-host start: `jax.distributed.initialize()` when the environment says we are one of many hosts."""

from __future__ import annotations

import os

import jax
from jax.sharding import Mesh

from pasta_jax.errors import ConfigError
from pasta_jax.model.mesh import MeshConfig, make_mesh
from pasta_jax.model.partitioning import RULES, batch_sharding, mesh_axis_size

_MULTI_HOST_HINTS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def is_multi_host_environment() -> bool:
  """TPU pod slices list several worker hostnames; GPU clusters name a coordinator (or run under SLURM)."""
  if any(os.environ.get(k) for k in _MULTI_HOST_HINTS):
    return True
  workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([w for w in workers.split(",") if w.strip()]) > 1:
    return True
  return int(os.environ.get("SLURM_NTASKS", "1")) > 1


def maybe_initialize_distributed(force: bool = False) -> None:
  """Call before any other JAX work. On TPU VMs jax discovers peers itself; elsewhere it reads the env."""
  if force or is_multi_host_environment():
    jax.distributed.initialize()


def is_main_process() -> bool:
  return jax.process_index() == 0


def batch_slice(mesh: Mesh | MeshConfig) -> tuple[int, int]:
  """(index, count): this process feeds slice `index` of `count` equal slices of every global batch (the data
  pipeline's shard_index and shard_count), which `step.place_batch` places on its devices. Processes whose devices
  hold the same batch rows (a mesh whose batch axes do not span them, e.g. tensor across hosts) are replicas and
  must feed the same slice: so `count` is the number of distinct row sets the processes hold, not the number of
  processes. A MeshConfig is laid over all devices, as the trainer lays it."""
  mesh = make_mesh(mesh) if isinstance(mesh, MeshConfig) else mesh
  shards = mesh_axis_size(dict(mesh.shape), RULES["batch"])
  rows: dict[int, set[int]] = {}
  for device, index in batch_sharding(mesh, 1).devices_indices_map((shards,)).items():
    rows.setdefault(device.process_index, set()).update(range(shards)[index[0]])
  distinct = sorted({tuple(sorted(r)) for r in rows.values()})
  if sum(len(r) for r in distinct) != shards or len({len(r) for r in distinct}) > 1:  # overlapping or unequal
    raise ConfigError(f"mesh {dict(mesh.shape)}: the processes' devices hold overlapping or unequal parts of the "
                      f"batch ({distinct}); order the devices so that each process holds as many whole batch shards")
  return distinct.index(tuple(sorted(rows[jax.process_index()]))), len(distinct)
