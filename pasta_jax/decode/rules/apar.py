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
from typing import ClassVar

import jax
import jax.numpy as jnp

from pasta_jax.decode.constraints import AllowedTokens, constrain
from pasta_jax.decode.pool import inserted_rows, kth_true, lowest_free_slots, usable_slots, write_slots
from pasta_jax.decode.rules.base import InterpreterConfig, Rules, StepFeed
from pasta_jax.decode.state import DONE, FREE, RUNNING, InterpState
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
  parent_lane = jnp.minimum(kth_true(spawns_ok, jnp.where(target, free_rank, 0)), cfg.lanes - 1)
  feed = (running & ~(forking & ~spawns_ok)) | target
  needed = feed.sum(axis=1)
  # Every running lane waits on a fork that no lane can take: nothing will ever free one. Stop.
  deadlock = state.live & jnp.any(running, axis=1) & (needed == 0)
  room = (usable_slots(state).sum(axis=1) >= needed) & ~deadlock
  feed = feed & room[:, None]
  target = target & room[:, None]
  slots = lowest_free_slots(feed, state, cfg.pool_slots)
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


@dataclasses.dataclass(frozen=True)
class AparRules(Rules):
  """APAR (Liu et al. 2024): any thread forks at APAR_FORK, a child never syncs, finished children's
  slots are released early."""

  name: ClassVar[str] = "apar"
  max_depth: int = 3  # a thread at this depth (main = 0) may not fork

  def validate(self, cfg: InterpreterConfig) -> None:
    super().validate(cfg)
    if self.max_depth < 0:
      raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")

  def max_records(self, cfg: InterpreterConfig) -> int:
    # Released slots are reused: each step records one sampled token per feeding lane, plus one
    # inserted child per spawn.
    return cfg.max_steps * cfg.lanes + cfg.max_threads + 1

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    plan = plan_apar(state, cfg)
    state = apply_spawn(state, plan, cfg)
    batch, lanes = state.token.shape
    inserted = inserted_rows(state, jnp.broadcast_to(jnp.arange(lanes, dtype=jnp.int32), (batch, lanes)))
    state = write_slots(state, plan.feed, plan.slots)
    return state, StepFeed(plan.feed, plan.slots, inserted, plan.target, plan)

  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig):
    """No fork right after a fork or child token (grammar), at the depth limit or while no lane is free
    (limits). A row counts as a refused fork when [Fork] is its most likely token under the grammar alone:
    what greedy decoding would have written. The sampled token itself is unchanged by the count."""
    b = jnp.arange(rows_lane.shape[0])[:, None]
    tables = AllowedTokens.build(cfg.vocab, logits.shape[-1])
    fed = state.token[b, rows_lane]
    grammar_no_fork = (fed == cfg.vocab.apar_fork) | (fed == cfg.vocab.apar_child)
    limited = (state.depth[b, rows_lane] >= self.max_depth) | ~lane_free(state)[:, None]
    top = jnp.argmax(constrain(logits, tables.for_apar_rows(grammar_no_fork)), axis=-1)
    refused = limited & ~grammar_no_fork & (top == cfg.vocab.apar_fork)
    return tables.for_apar_rows(grammar_no_fork | limited), refused

  def after_model(self, state: InterpState, step: StepFeed, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array):
    return apply_samples(state, step.plan, sampled, cfg)
