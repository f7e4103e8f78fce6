"""The one visibility rule. Every attention mask in the project comes from `visible`.

Each written token (a sequence position in training, a pool slot in decoding) carries its owner
thread, the order in which it was written, and a valid bit. Each query row carries a horizon per
thread: the largest write order of that thread's tokens it may see (-1: none of them).

  visible(q, k) = valid[k] and order[k] <= horizon[q, owner[k]]

The horizons are the thread table. A thread sees its own tokens up to itself, and what its parent
saw at its spawn. So the same rule gives:
  - PASTA training: order = index in the laid-out answer; a fork's horizon on main is its
    promise's index; main's horizon on a fork becomes unbounded at the `<sync/>` that waits for it.
  - PASTA decoding: order = pool write order over the interleaved pool.
  - APAR: children get main's horizon at the fork; main never gets theirs; no sync.
  - Token trees (Medusa/ProPD): a node is a one-token thread whose horizons cover its ancestors.
The mask is computed from this small metadata, never stored per request as an L x L tensor.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

UNBOUNDED = 2**30  # horizon meaning "every token this thread has written, now or later"
HIDDEN = -1  # horizon meaning "none of this thread's tokens"


def visible(horizon: jax.Array, owner: jax.Array, order: jax.Array, valid: jax.Array) -> jax.Array:
  """Attention mask from thread metadata.

  horizon: [..., Q, U] int32, per query row and thread.
  owner, order: [..., S] int32 and valid: [..., S] bool, per key.
  Returns [..., Q, S] bool.
  """
  num_queries = horizon.shape[-2]
  owner_q = jnp.broadcast_to(owner[..., None, :], owner.shape[:-1] + (num_queries, owner.shape[-1]))
  limit = jnp.take_along_axis(horizon, owner_q, axis=-1)  # [..., Q, S]
  return valid[..., None, :] & (order[..., None, :] <= limit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ThreadMask:
  """The metadata `visible` reads, for one model call: what the model takes instead of a dense mask, so an
  attention kernel can compute each tile's mask itself (`model/thread_attention.py`)."""

  horizon: jax.Array  # [B, Q, U] int32 per query row and thread
  owner: jax.Array  # [B, S] int32 per key
  order: jax.Array  # [B, S] int32
  valid: jax.Array  # [B, S] bool

  def dense(self) -> jax.Array:
    """[B, Q, S] bool: the mask itself (XLA attention); the kernels never build it."""
    return visible(self.horizon, self.owner, self.order, self.valid)
