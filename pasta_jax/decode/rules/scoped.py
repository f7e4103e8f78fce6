"""The earlier paper's scoped mode (`000_…`; docs/interpreter.md "Scoped mode"), as array ops over [B, T].

The reference (`decode/reference/scoped.py`) states the rules one request at a time; here they are:
  - any running lane whose pending token is `<promise/>` spawns a child on a free lane in the step it
    feeds it (k-th spawner in lane order -> k-th free lane); the child's `<async>` (inserted) feeds in
    the same step with the spawner's view up to its promise. Spawners left without a lane stall;
  - `</scope>` feeds once no thread of its scope's subtree runs; then the lane's horizon on every such
    thread becomes unbounded, before attention, so `</scope>` and all after it see them as written;
  - a lane's next position is the number of slots its query saw (the size of the next token's
    synchronous prefix), so positions need no bookkeeping beyond the one visibility rule.

The rule's own state (`ScopedState`) keeps the scope stacks; the thread table keeps the rest: `depth` is
a lane's fork depth, `parent` each thread's spawner.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pasta_jax.decode.constraints import constrain
from pasta_jax.decode.pool import append_slots, inserted_rows, kth_true, write_slots
from pasta_jax.decode.rules.base import InterpreterConfig, Rules, StepFeed
from pasta_jax.decode.state import CLOSING, DONE, FREE, RUNNING, InterpState
from pasta_jax.lang.scoped import DEFAULT_MAX_DEPTH
from pasta_jax.visibility import UNBOUNDED, visible


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScopedState:
  scopes: jax.Array  # [B, T] int32 scopes the lane's thread has open
  marks: jax.Array  # [B, T, D] int32 per open scope: next_thread when it opened (its children have ids >= it)
  base_scope: jax.Array  # [B, T] int32 scope depth the lane's thread was spawned at
  ancestors: jax.Array  # [B, U, U] bool: ancestors[u, a] = a spawned u, or an ancestor of u's spawner did
  fed: jax.Array  # [B, T] bool: the lanes that feed this step (the reservation of lanes for promises)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ScopedPlan:
  feed: jax.Array  # [B, T] bool
  child: jax.Array  # [B, T] bool: a child spawns on this free lane and feeds its `<async>`
  spawner: jax.Array  # [B, T] int32: for a child lane, the lane that fed the promise
  synced: jax.Array  # [B, T, U] bool: for a lane feeding `</scope>`, the threads it now sees
  main_done: jax.Array  # [B] bool
  stalls: jax.Array  # [B] int32 spawners left without a lane or thread id
  stop: jax.Array  # [B] bool: no room in the pool for this step's writes, or a deadlock


def scope_subtree(state: InterpState, rs: ScopedState, cfg: InterpreterConfig) -> jax.Array:
  """[B, T, U] bool: the threads inside each lane's innermost open scope: its children spawned since the
  scope opened (ids >= the scope's mark) and all their descendants."""
  level = jnp.clip(rs.scopes - 1, 0, rs.marks.shape[-1] - 1)
  mark = jnp.take_along_axis(rs.marks, level[..., None], axis=-1)[..., 0]  # [B, T]
  threads = jnp.arange(cfg.max_threads)
  child = (state.parent[:, None, :] == state.thread[..., None]) & (threads >= mark[..., None])  # [B, T, U]
  below = jnp.einsum("bua,bta->btu", rs.ancestors.astype(jnp.int32), child.astype(jnp.int32)) > 0
  return child | below


def scoped_allowed(vocab, vocab_size: int, *, open_scopes, scope_depth, fork_depth, is_main, may_fork,
                   max_depth: int) -> jax.Array:
  """[..., V] bool: what a lane may sample in the scoped mode, per row of the [...] arrays (the rules of
  the reference's `scoped_constraint_mask`): never `<async>` or the later form's tags; `<scope>` below the
  scope-depth limit; `</scope>` with an open scope; `</async>` and end ids with none (`</async>` in forks
  only); `<promise/>` below the fork-depth limit, in main only inside a scope, and only when `may_fork`."""
  ids = jnp.arange(vocab_size)
  usable = {vocab.scope_open, vocab.scope_close, vocab.bare_promise, vocab.async_close}
  banned = jnp.isin(ids, jnp.asarray(sorted(vocab.tag_ids - usable), jnp.int32))
  ends = jnp.isin(ids, jnp.asarray(vocab.eos_ids))

  def when(token_mask, condition):  # ban `token_mask` on the rows where `condition` holds
    return token_mask & condition[..., None]

  is_open, is_close, is_promise, is_async_end = (ids == t for t in (vocab.scope_open, vocab.scope_close,
                                                                    vocab.bare_promise, vocab.async_close))
  no_promise = (fork_depth >= max_depth) | (is_main & (open_scopes == 0)) | ~may_fork
  banned_rows = (when(is_open, scope_depth >= max_depth) | when(is_close, open_scopes == 0)
                 | when(is_async_end | ends, open_scopes > 0) | when(is_async_end, is_main)
                 | when(is_promise, no_promise))
  return ~banned & ~banned_rows


def plan_scoped(state: InterpState, rs: ScopedState, cfg: InterpreterConfig) -> ScopedPlan:
  """Who feeds this step: every running lane but spawners without a lane, `</scope>`s whose subtree still runs
  and main's end id; the new children; closing lanes. A step without room for every write, or in which nothing
  can feed (a deadlock only a forced script can build), changes nothing and stops the request."""
  vocab, b = cfg.vocab, jnp.arange(state.token.shape[0])[:, None]
  lanes = jnp.arange(cfg.lanes)
  live = state.live[:, None]
  running = live & (state.status == RUNNING)
  promise = running & (state.token == vocab.bare_promise)
  closer = running & (state.token == vocab.scope_close) & (rs.scopes > 0)
  main_end = running & (lanes == 0) & jnp.isin(state.token, jnp.asarray(vocab.eos_ids))
  subtree = scope_subtree(state, rs, cfg)
  thread_runs = jnp.zeros((state.token.shape[0], cfg.max_threads), bool).at[b, state.thread].max(running)
  blocked = closer & jnp.any(subtree & thread_runs[:, None, :], axis=-1)
  forks_run = jnp.any(running & (lanes > 0), axis=1)
  main_done = main_end[:, 0] & ~forks_run
  free = (state.status == FREE) & (lanes > 0)
  rank = jnp.cumsum(promise, axis=1) - 1
  room_for = jnp.minimum(free.sum(axis=1), cfg.max_threads - state.next_thread)[:, None]
  spawn = promise & (rank < room_for)
  free_rank = jnp.cumsum(free, axis=1) - 1
  child = free & (free_rank < spawn.sum(axis=1, keepdims=True))
  spawner = jnp.minimum(kth_true(spawn, jnp.where(child, free_rank, 0)), cfg.lanes - 1)
  feed = (running & ~promise & ~blocked & ~main_end) | spawn | child | (live & (state.status == CLOSING))
  needed = feed.sum(axis=1)
  room = state.next_slot + needed <= state.slot_limit
  deadlock = state.live & (needed == 0) & ~main_done
  stop = state.live & ((~room & (needed > 0)) | deadlock)
  go = ~stop[:, None]
  return ScopedPlan(feed & go, child & go, spawner, (closer & feed & go)[..., None] & subtree,
                    main_done & ~stop, jnp.where(stop, 0, (promise & ~spawn).sum(axis=1)).astype(jnp.int32), stop)


def spawn_children(state: InterpState, rs: ScopedState, plan: ScopedPlan, cfg: InterpreterConfig):
  """Children start on their lanes: `<async>` pending, the spawner's view up to its promise (written this
  step at write order next_slot + its feed offset), fork depth + 1, the spawner's scope depth."""
  b = jnp.arange(state.token.shape[0])[:, None]
  child, spawner = plan.child, plan.spawner
  new_thread = state.next_thread[:, None] + jnp.cumsum(child, axis=1) - 1
  spawner_thread = state.thread[b, spawner]
  promise_order = state.next_slot[:, None] + (jnp.cumsum(plan.feed, axis=1) - 1)[b, spawner]
  threads = jnp.arange(cfg.max_threads)
  rows = state.horizon[b, spawner]
  rows = jnp.where(threads == spawner_thread[..., None], promise_order[..., None], rows)
  rows = jnp.where(threads == new_thread[..., None], UNBOUNDED, rows)
  new_ids = jnp.where(child, new_thread, cfg.max_threads)
  lineage = rs.ancestors[b, spawner_thread] | (threads == spawner_thread[..., None])  # [B, T, U]

  def put(array, value):
    return jnp.where(child, value, array)

  state = dataclasses.replace(
      state, status=put(state.status, RUNNING), thread=put(state.thread, new_thread),
      token=put(state.token, cfg.vocab.async_open), depth=put(state.depth, state.depth[b, spawner] + 1),
      horizon=jnp.where(child[..., None], rows, state.horizon),
      parent=state.parent.at[b, new_ids].set(spawner_thread, mode="drop"),
      next_thread=state.next_thread + child.sum(axis=1))
  rs = dataclasses.replace(
      rs, scopes=put(rs.scopes, 0), base_scope=put(rs.base_scope, rs.base_scope[b, spawner] + rs.scopes[b, spawner]),
      ancestors=rs.ancestors.at[b, new_ids].set(lineage, mode="drop"))
  return state, rs


@dataclasses.dataclass(frozen=True)
class ScopedRules(Rules):
  """Scoped PASTA (the earlier paper): `<scope>` nests, `<promise/>` forks at once in any thread, and
  `</scope>` waits only for the forks of its own scope."""

  name: ClassVar[str] = "pasta-v0"
  max_depth: int = DEFAULT_MAX_DEPTH  # limit of scope nesting, and of fork nesting (constraints only)

  def validate(self, cfg: InterpreterConfig) -> None:
    super().validate(cfg)
    if self.initial_threads != 1:
      raise ValueError("scoped threads start at promises: initial_threads must be 1")
    if self.max_depth < 1:
      raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")

  def init_rule_state(self, prompt_tokens, lengths, rule_inputs, cfg: InterpreterConfig) -> ScopedState:
    super().init_rule_state(prompt_tokens, lengths, rule_inputs, cfg)
    batch = lengths.shape[0]
    zeros = jnp.zeros((batch, cfg.lanes), jnp.int32)
    return ScopedState(zeros, jnp.zeros((batch, cfg.lanes, self.max_depth), jnp.int32), zeros,
                       jnp.zeros((batch, cfg.max_threads, cfg.max_threads), bool), zeros > 0)

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    del length_table
    rs = state.rule_state
    plan = plan_scoped(state, rs, cfg)
    state, rs = track(state, rs, plan, cfg)
    state, rs = spawn_children(state, rs, plan, cfg)
    slots = append_slots(plan.feed, state, cfg.pool_slots)
    state = write_slots(state, plan.feed, slots)
    seen = visible(state.horizon, state.slot_owner, state.slot_order, state.slot_valid).sum(axis=-1)  # [B, T]
    b = jnp.arange(state.token.shape[0])[:, None]
    # A child's `<async>` sits at |V(promise)|: the size of what its spawner's query sees this step.
    position = jnp.where(plan.child, seen[b, plan.spawner], state.position).astype(jnp.int32)
    slot_pos = state.slot_pos.at[b, jnp.where(plan.child, slots, cfg.pool_slots)].set(position, mode="drop")
    state = dataclasses.replace(state, position=position, slot_pos=slot_pos,
                                rule_state=dataclasses.replace(rs, fed=plan.feed))
    lanes = jnp.broadcast_to(jnp.arange(cfg.lanes, dtype=jnp.int32), plan.feed.shape)
    return state, StepFeed(plan.feed, slots, inserted_rows(state, lanes), plan.child, (plan, seen))

  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig):
    """The constraint masks (`scoped_allowed`) per query row; a row counts a refused promise when
    `<promise/>` is its most likely token under the grammar but a limit (depth, lane reservation) bans it."""
    vocab, rs = cfg.vocab, state.rule_state
    b = jnp.arange(rows_lane.shape[0])[:, None]
    lanes = jnp.arange(cfg.lanes)
    free_now = ((state.status == FREE) & (lanes > 0)).sum(axis=1)
    waiting = ((state.status == RUNNING) & ~rs.fed & (state.token == vocab.bare_promise)).sum(axis=1)
    open_ = rs.scopes[b, rows_lane]
    args = dict(vocab=vocab, vocab_size=logits.shape[-1], open_scopes=open_,
                scope_depth=rs.base_scope[b, rows_lane] + open_, is_main=rows_lane == 0, max_depth=self.max_depth)
    grammar = scoped_allowed(fork_depth=jnp.zeros_like(open_), may_fork=jnp.ones_like(open_, bool), **args)
    allowed = scoped_allowed(fork_depth=state.depth[b, rows_lane], may_fork=(rows_lane == 0) |
                             (free_now > waiting)[:, None], **args)
    top = jnp.argmax(constrain(logits, grammar), axis=-1)
    refused = ~allowed[..., vocab.bare_promise] & grammar[..., vocab.bare_promise] & (top == vocab.bare_promise)
    return allowed, refused

  def script_end(self, rows_lane: jax.Array, cfg: InterpreterConfig) -> jax.Array:
    return jnp.where(rows_lane == 0, cfg.vocab.eos_ids[0], cfg.vocab.async_close).astype(jnp.int32)

  def after_model(self, state: InterpState, step: StepFeed, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array):
    del length_table
    plan, seen = step.plan
    vocab = cfg.vocab
    is_fork = jnp.arange(cfg.lanes) > 0
    closing_done = plan.feed & (state.status == CLOSING)
    kept = plan.feed & ~closing_done
    closes = is_fork & ((sampled == vocab.async_close) | jnp.isin(sampled, jnp.asarray(vocab.eos_ids)))
    status = jnp.where(kept & closes, CLOSING, state.status)
    status = jnp.where(closing_done, FREE, status)
    status = status.at[:, 0].set(jnp.where(plan.main_done, DONE, status[:, 0]))
    finished = (status[:, 0] == DONE) & jnp.all((status == FREE) | ~is_fork, axis=1)
    state = dataclasses.replace(
        state,
        token=jnp.where(kept, jnp.where(closes, vocab.async_close, sampled), state.token),
        position=jnp.where(kept, seen, state.position).astype(jnp.int32),
        status=status,
        finished=state.finished | finished,
        truncated=state.truncated | plan.stop,
        pool_full=state.pool_full | plan.stop,
        stalls=state.stalls + plan.stalls,
        last_fed_step=jnp.where(jnp.any(plan.feed, axis=1), state.step, state.last_fed_step))
    return state, kept


def track(state: InterpState, rs: ScopedState, plan: ScopedPlan, cfg: InterpreterConfig):
  """Scope bookkeeping on the fed tokens (before spawns: a child lane's token is not its own yet)."""
  b = jnp.arange(state.token.shape[0])[:, None]
  fed_running = plan.feed & (state.status == RUNNING)
  opens = fed_running & (state.token == cfg.vocab.scope_open)
  closes = fed_running & (state.token == cfg.vocab.scope_close) & (rs.scopes > 0)
  level = jnp.where(opens, rs.scopes, rs.marks.shape[-1])
  lane_ids = jnp.broadcast_to(jnp.arange(cfg.lanes)[None, :], level.shape)
  marks = rs.marks.at[b, lane_ids, level].set(jnp.broadcast_to(state.next_thread[:, None], level.shape),
                                               mode="drop")
  rs = dataclasses.replace(rs, scopes=rs.scopes + opens - closes, marks=marks)
  return dataclasses.replace(state, horizon=jnp.where(plan.synced, UNBOUNDED, state.horizon)), rs
