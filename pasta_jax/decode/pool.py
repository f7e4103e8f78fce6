"""The interleaved KV pool's slot metadata: which slot each feeding lane writes, and what it records there.

The K/V arrays themselves are `model.gemma.KVPool` ([layers, B, S, K, hd]); the model writes them at
the slots given here. The metadata ([B, S] owner thread, write order, position, valid) is all the
visibility rule (`pasta_jax.visibility.visible`) reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pasta_jax.decode.state import InterpState


def write_slots(state: InterpState, feed: jax.Array, slots: jax.Array) -> InterpState:
  """Feeding lanes [B, T] write their thread, token, position and a fresh write order (consecutive, in lane
  order) at `slots` [B, T] (S: no write). Updates the append pointer and the peak of live slots."""
  b = jnp.arange(slots.shape[0])[:, None]
  orders = state.next_slot[:, None] + jnp.cumsum(feed, axis=1) - 1

  def put(array, value):
    return array.at[b, slots].set(value, mode="drop")

  valid = put(state.slot_valid, True)
  written = state.next_slot + feed.sum(axis=1)
  return dataclasses.replace(
      state, slot_owner=put(state.slot_owner, state.thread), slot_order=put(state.slot_order, orders),
      slot_pos=put(state.slot_pos, state.position), slot_token=put(state.slot_token, state.token), slot_valid=valid,
      next_slot=written,
      peak_live=jnp.maximum(state.peak_live, valid.sum(axis=1).astype(jnp.int32)))


def append_slots(feed: jax.Array, state: InterpState, pool_slots: int) -> jax.Array:
  """[B, T] slots for an append-only pool: feeding lanes take the next slots in lane order (S: none)."""
  offsets = jnp.cumsum(feed, axis=1) - 1
  return jnp.where(feed, state.next_slot[:, None] + offsets, pool_slots).astype(jnp.int32)


def lowest_free_slots(feed: jax.Array, state: InterpState, pool_slots: int) -> jax.Array:
  """[B, T] slots for a pool that frees slots: feeding lanes take the lowest invalid slots, in lane order."""
  offsets = jnp.cumsum(feed, axis=1) - 1
  return jnp.where(feed, kth_true(usable_slots(state), jnp.maximum(offsets, 0)), pool_slots).astype(jnp.int32)


def usable_slots(state: InterpState) -> jax.Array:
  """[B, S] bool: free slots below each request's slot limit."""
  return ~state.slot_valid & (jnp.arange(state.slot_valid.shape[1])[None, :] < state.slot_limit[:, None])


def kth_true(mask: jax.Array, k: jax.Array) -> jax.Array:
  """Index of the (k+1)-th True of each row of `mask` [B, N], for k [B, M]; N where there is none."""
  counts = jnp.cumsum(mask, axis=1)
  return jax.vmap(lambda c, kk: jnp.searchsorted(c, kk + 1, side="left"))(counts, k).astype(jnp.int32)


def inserted_rows(state: InterpState, lanes: jax.Array) -> jax.Array:
  """[B, K, 5] records (step, lane, thread, token, position) of the pending tokens of `lanes` [B, K]."""
  b = jnp.arange(lanes.shape[0])[:, None]
  return jnp.stack([jnp.broadcast_to(state.step, lanes.shape), lanes, state.thread[b, lanes], state.token[b, lanes],
                    state.position[b, lanes]], axis=2).astype(jnp.int32)
