"""What both thread-metadata attention kernels share: the per-block summaries that let a kernel skip a tile
without looking at its keys, and the finite "minus infinity" of their online softmax."""

from __future__ import annotations

import jax.numpy as jnp

from pasta_jax.visibility import ThreadMask

NEG = -1e30  # a finite "minus infinity": a fully masked tile must not turn the running max into NaN
NO_KEY = 2**31 - 1  # a key block's smallest order for a thread with no valid key there


def block_summaries(mask: ThreadMask, q_blocks: int, k_blocks: int):
  """([B, nq, U] largest horizon per thread over each query block's rows, [B, nk, U] smallest write order per
  thread over each key block's valid keys): a tile (i, j) can see something iff some thread u has
  kv_min[j, u] <= q_max[i, u]. Both are O((Q + S) U): the small metadata, never the [Q, S] mask."""
  b, nq_rows, u = mask.horizon.shape
  q_max = mask.horizon.reshape(b, q_blocks, nq_rows // q_blocks, u).max(axis=2)
  s = mask.owner.shape[1]
  owned = (mask.owner[..., None] == jnp.arange(u)) & mask.valid[..., None]  # [B, S, U]
  orders = jnp.where(owned, mask.order[..., None], NO_KEY).reshape(b, k_blocks, s // k_blocks, u)
  return q_max, orders.min(axis=2)
