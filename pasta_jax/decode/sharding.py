"""Decoding under a mesh: the same loop, with weights, pool and requests placed by the trainer's rules.

Nothing in the step knows about devices. The weights are placed by `model.partitioning` (the rules
the trainer uses: heads, KV heads, MLP hidden and vocabulary over `tensor`, the embedding dimension over
`fsdp`), the requests' inputs over `data` x `fsdp` when the batch divides it, and the pool created in
prefill is constrained to [layers, B over data x fsdp, S, KV heads over tensor, head_dim]; the compiler
(GSPMD) propagates those placements through the jitted prefill and `lax.while_loop`, so every method runs
sharded through the one `generate`.

KV heads that do not divide the tensor axis (Gemma 2B's and 3 270M's single KV head, MQA) are
replicated, pool included: each tensor shard then keeps the whole (small) K/V and computes its own
query heads against it. Queries, `o`, the MLP and the vocabulary stay split.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pasta_jax.model.partitioning import RULES, mesh_axis_size, param_shardings

BATCH_AXES = RULES["batch"]  # requests: data x fsdp


@dataclasses.dataclass(frozen=True)
class DecodeSharding:
  """Where decoding's arrays live on `mesh` (a (data, fsdp, tensor) jax Mesh). Hashable: part of the
  jit-static interpreter config."""

  mesh: Mesh

  def batch_axes(self, batch: int):
    """The mesh axes requests split over: data x fsdp when the batch divides them, else none."""
    return BATCH_AXES if batch % mesh_axis_size(dict(self.mesh.shape), BATCH_AXES) == 0 else None

  def pool_spec(self, batch: int, kv_heads: int) -> PartitionSpec:
    heads = "tensor" if kv_heads % self.mesh.shape["tensor"] == 0 else None
    return PartitionSpec(None, self.batch_axes(batch), None, heads, None)

  def constrain_pool(self, pool):
    """[layers, B, S, K, hd] K/V arrays placed by `pool_spec` (inside jit)."""
    spec = self.pool_spec(pool.k.shape[1], pool.k.shape[3])
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec)), pool)

  def put_params(self, params):
    """Decode-layout weights placed by the trainer's logical-axis rules."""
    return jax.device_put(params, param_shardings(params, self.mesh))

  def put_requests(self, arrays):
    """Per-request arrays (leading axis B) split over the batch axes when B divides them."""
    def place(x):
      axes = self.batch_axes(np.shape(x)[0])
      return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec(axes, *([None] * (np.ndim(x) - 1)))))
    return jax.tree.map(place, arrays)

  def put_replicated(self, arrays):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(self.mesh, PartitionSpec())), arrays)
