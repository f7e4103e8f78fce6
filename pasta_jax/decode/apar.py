"""APAR's thread transitions (the APAR paper, section 2.2 and Algorithm 1), as array ops over [B, T].

The same interpreter state, model step, sampler and visibility rule as PASTA; only the transitions
differ (docs/interpreter.md, APAR mode):
  - any running lane whose pending token is APAR_FORK spawns a child on a free lane in the step it
    feeds the fork; the child's pending APAR_CHILD (inserted) feeds in that same step. Both the child
    and the parent's next token sit at the fork's position + 1 (exact path positions);
  - a child sees its parent's view up to and including the fork; nobody ever sees a child (no sync);
  - several lanes may fork in one step: the k-th forking lane (lane order) takes the k-th free lane;
    a forking lane with no free lane or thread id left stalls (counted). Sampling may fork only
    while a lane is free; a forced script can still make every running lane wait on a fork at once,
    and that deadlock stops the request as truncated;
  - an end id finishes any thread at once (it is recorded, never fed); the request finishes when no
    lane runs. Then every slot that no running thread can see is released and reused (early release).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pasta_jax.decode.state import DONE, FREE, RUNNING, InterpreterConfig, InterpState
from pasta_jax.visibility import UNBOUNDED, visible


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AparPlan:
  feed: jax.Array  # [B, T] bool: the lane feeds its pending token this step
  target: jax.Array  # [B, T] bool: a child spawns on this (free) lane and feeds APAR_CHILD
  parent_lane: jax.Array  # [B, T] int32: for a target lane, the lane that forked
  new_thread: jax.Array  # [B, T] int32: for a target lane, the child's thread id
  stalls: jax.Array  # [B] int32: forking lanes that wait for a free lane or thread id
  slots: jax.Array  # [B, T] int32: the pool slot each feeding lane writes (S where none)
  out_of_room: jax.Array  # [B] bool: fewer free slots than feeding lanes, or a deadlock


def _kth(mask: jax.Array, k: jax.Array) -> jax.Array:
  """Index of the (k+1)-th True of each row of `mask` [B, N], for k [B, M]; N where there is none."""
  counts = jnp.cumsum(mask, axis=1)
  return jax.vmap(lambda c, kk: jnp.searchsorted(c, kk + 1, side="left"))(counts, k).astype(jnp.int32)


def plan_apar(state: InterpState, cfg: InterpreterConfig) -> AparPlan:
  lanes = jnp.arange(cfg.lanes)
  running = state.live[:, None] & (state.status == RUNNING)
  forking = running & (state.token == cfg.vocab.apar_fork)
  free = (state.status == FREE) & (lanes > 0)
  fork_rank = jnp.cumsum(forking, axis=1) - 1
  spawns_ok = forking & (fork_rank < free.sum(axis=1, keepdims=True)) & \
      (state.next_thread[:, None] + fork_rank < cfg.max_threads)
  num_spawns = spawns_ok.sum(axis=1, keepdims=True)
  free_rank = jnp.cumsum(free, axis=1) - 1
  target = free & (free_rank < num_spawns)
  parent_lane = jnp.minimum(_kth(spawns_ok, jnp.where(target, free_rank, 0)), cfg.lanes - 1)
  feed = (running & ~(forking & ~spawns_ok)) | target
  needed = feed.sum(axis=1)
  # Every running lane waits on a fork that no lane can take: nothing will ever free one. Stop.
  deadlock = state.live & jnp.any(running, axis=1) & (needed == 0)
  room = ((~state.slot_valid).sum(axis=1) >= needed) & ~deadlock
  feed = feed & room[:, None]
  target = target & room[:, None]
  offsets = jnp.cumsum(feed, axis=1) - 1
  slots = jnp.where(feed, _kth(~state.slot_valid, jnp.maximum(offsets, 0)), cfg.pool_slots)
  stalls = jnp.where(room, (forking & ~spawns_ok).sum(axis=1), 0)
  return AparPlan(feed, target, parent_lane, state.next_thread[:, None] + free_rank, stalls.astype(jnp.int32),
                  slots.astype(jnp.int32), state.live & ~room & jnp.any(running, axis=1))


def lane_free(state: InterpState) -> jax.Array:
  """[B] bool: a fork lane is free now. Sampling may fork only then, so lanes never deadlock."""
  return jnp.any((state.status == FREE) & (jnp.arange(state.status.shape[1]) > 0), axis=1)


def apply_spawn(state: InterpState, plan: AparPlan, cfg: InterpreterConfig) -> InterpState:
  """Children start on their target lanes: APAR_CHILD pending at the fork's position + 1, the
  parent's view up to its fork (written this step at write order next_slot + its feed offset)."""
  b = jnp.arange(state.token.shape[0])[:, None]
  parent = plan.parent_lane
  parent_thread = state.thread[b, parent]
  parent_order = state.next_slot[:, None] + (jnp.cumsum(plan.feed, axis=1) - 1)[b, parent]
  rows = state.horizon[b, parent]  # [B, T, U]
  threads = jnp.arange(cfg.max_threads)
  rows = jnp.where(threads == parent_thread[..., None], parent_order[..., None], rows)
  rows = jnp.where(threads == plan.new_thread[..., None], UNBOUNDED, rows)
  target = plan.target

  def put(array, value):
    return jnp.where(target, value, array)

  new_ids = jnp.where(target, plan.new_thread, cfg.max_threads)
  return dataclasses.replace(
      state,
      status=put(state.status, RUNNING),
      thread=put(state.thread, plan.new_thread),
      token=put(state.token, cfg.vocab.apar_child),
      position=put(state.position, state.position[b, parent] + 1),
      depth=put(state.depth, state.depth[b, parent] + 1),
      horizon=jnp.where(target[..., None], rows, state.horizon),
      parent=state.parent.at[b, new_ids].set(parent_thread, mode="drop"),
      next_thread=state.next_thread + target.sum(axis=1),
  )


def assign_slots(state: InterpState, plan: AparPlan) -> InterpState:
  """Feeding lanes write the lowest free slots in lane order, with consecutive write orders."""
  b = jnp.arange(state.token.shape[0])[:, None]
  orders = state.next_slot[:, None] + jnp.cumsum(plan.feed, axis=1) - 1

  def put(array, value):
    return array.at[b, plan.slots].set(value, mode="drop")

  valid = put(state.slot_valid, True)
  return dataclasses.replace(
      state, slot_owner=put(state.slot_owner, state.thread), slot_order=put(state.slot_order, orders),
      slot_pos=put(state.slot_pos, state.position), slot_valid=valid,
      next_slot=state.next_slot + plan.feed.sum(axis=1),
      peak_live=jnp.maximum(state.peak_live, valid.sum(axis=1).astype(jnp.int32)))


def apply_samples(state: InterpState, plan: AparPlan, sampled: jax.Array, cfg: InterpreterConfig):
  """Sampled tokens [B, T] become pending; an end id finishes its thread. Returns (state, recorded)."""
  ended = plan.feed & jnp.isin(sampled, jnp.asarray(cfg.vocab.eos_ids))
  lane0 = jnp.arange(cfg.lanes) == 0
  status = jnp.where(ended, jnp.where(lane0, DONE, FREE), state.status)
  finished = state.live & ~jnp.any(status == RUNNING, axis=1)
  state = dataclasses.replace(
      state,
      token=jnp.where(plan.feed, sampled, state.token),
      position=jnp.where(plan.feed, state.position + 1, state.position),
      status=status,
      finished=state.finished | finished,
      truncated=state.truncated | plan.out_of_room,
      pool_full=state.pool_full | plan.out_of_room,
      stalls=state.stalls + plan.stalls,
      last_fed_step=jnp.where(jnp.any(plan.feed, axis=1), state.step, state.last_fed_step),
  )
  return release_unseen(state), plan.feed


def release_unseen(state: InterpState) -> InterpState:
  """Early release: a slot no running thread can see is freed (nobody can come to see it later:
  a new child's view is a part of its parent's, and no thread ever gains a view of another)."""
  running = state.status == RUNNING  # a truncated request keeps its pool as it stood
  seen = visible(state.horizon, state.slot_owner, state.slot_order, state.slot_valid)  # [B, T, S]
  needed = jnp.any(seen & running[..., None], axis=1)
  return dataclasses.replace(state, slot_valid=state.slot_valid & needed)


def spawn_records(state: InterpState, plan: AparPlan) -> tuple[jax.Array, jax.Array]:
  """[B, T, 5] rows of the inserted APAR_CHILD tokens (after apply_spawn) and which to keep."""
  batch, lanes = state.token.shape
  rows = jnp.stack([jnp.full((batch, lanes), state.step), jnp.broadcast_to(jnp.arange(lanes), (batch, lanes)),
                    state.thread, state.token, state.position], axis=2)
  return rows, plan.target
