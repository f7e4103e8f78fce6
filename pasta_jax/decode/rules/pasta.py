"""PASTA's rules: the thread transitions of one step, as array ops over [B, T] (docs/interpreter.md).

`plan_feeds` decides who feeds (stall, sync wait, implicit final sync, pool room); `apply_spawn`
and `release_sync` update the thread table before attention; `apply_samples` turns sampled tokens
into the next pending tokens, closes forks and frees lanes after attention.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pasta_jax.decode.constraints import AllowedTokens, cap_topics, open_topic_length, repeated_topic
from pasta_jax.decode.pool import append_slots, inserted_rows, write_slots
from pasta_jax.decode.rules.base import InterpreterConfig, Rules, StepFeed
from pasta_jax.decode.state import CLOSING, DONE, FREE, RUNNING, InterpState
from pasta_jax.lang import schema
from pasta_jax.lang.tags import reserved_span
from pasta_jax.visibility import UNBOUNDED


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FeedPlan:
  feed: jax.Array  # [B, T] bool: lane feeds its pending token this step
  spawn: jax.Array  # [B] bool: main's LENGTH feeds, a fork starts on `spawn_lane`
  spawn_lane: jax.Array  # [B] int32
  sync_release: jax.Array  # [B] bool: main's <sync/> feeds
  main_done: jax.Array  # [B] bool: main's end token is reached with no fork running
  stall: jax.Array  # [B] bool: main waits for a free lane or thread id
  out_of_room: jax.Array  # [B] bool: the pool cannot take this step's writes


def plan_feeds(state: InterpState, cfg: InterpreterConfig, length_table: jax.Array,
               free_slots: jax.Array | None = None) -> FeedPlan:
  """Who feeds this step, under `cfg.rules` (PastaRules, or the naive interpreter's variant). free_slots: [B]
  slots a pool that frees them has left (None: the append-only pool's room, up to each request's slot limit)."""
  rules, vocab = cfg.rules, cfg.vocab
  lane_idx = jnp.arange(cfg.lanes)
  live = state.live
  main_token = state.token[:, 0]
  main_running = live & (state.status[:, 0] == RUNNING)
  is_length = length_table[main_token] > 0
  is_end = jnp.isin(main_token, jnp.asarray(vocab.eos_ids))
  busy = (lane_idx > 0) & ((state.status == RUNNING) | (state.status == CLOSING))  # [B, T]
  blocking = busy if rules.sync_waits_for_closing else busy & (state.status == RUNNING)
  fork_blocking = jnp.any(blocking, axis=1)
  free = (state.status == FREE) & (lane_idx > 0)
  can_spawn = jnp.any(free, axis=1) & (state.next_thread < cfg.max_threads)
  stall = main_running & is_length & ~can_spawn
  wait = main_running & ((main_token == vocab.sync) | is_end) & fork_blocking
  main_done = main_running & is_end & ~fork_blocking
  main_feeds = main_running & ~is_end & ~stall & ~wait
  spawn_lane = jnp.argmax(free, axis=1).astype(jnp.int32)
  spawn = main_feeds & is_length
  feed = (live[:, None] & busy) | ((lane_idx == 0) & main_feeds[:, None])
  if rules.fork_feeds_at_spawn:
    feed = feed | (spawn[:, None] & (lane_idx == spawn_lane[:, None]))
  writes = feed.sum(axis=1)
  room = state.next_slot + writes <= state.slot_limit if free_slots is None else writes <= free_slots
  out_of_room = live & jnp.any(feed, axis=1) & ~room
  # A step without room changes nothing but `truncated`: no feed, spawn, stall or implicit sync.
  return FeedPlan(feed & room[:, None], spawn & room, spawn_lane, main_feeds & room & (main_token == vocab.sync),
                  main_done & room, stall & room, out_of_room)


def apply_spawn(state: InterpState, plan: FeedPlan, cfg: InterpreterConfig) -> InterpState:
  """Starts a fork on the spawn lane: `<async>` pending at p + 1, main's view up to its promise.
  The thread table is small ([B, T], [B, T, U]), so each field is rewritten whole under one mask: XLA fuses these
  selects into a kernel or two, where one scatter per field was a kernel each on a GPU."""
  new_thread = state.next_thread
  on_lane = plan.spawn[:, None] & (jnp.arange(state.token.shape[1])[None, :] == plan.spawn_lane[:, None])  # [B, T]
  thread_idx = jnp.arange(state.horizon.shape[-1])[None, :]
  is_new = thread_idx == new_thread[:, None]  # [B, U]; none once the ids run out
  row = jnp.where(thread_idx == 0, state.next_slot[:, None], state.horizon[:, 0, :])  # main feeds first: next_slot
  row = jnp.where(is_new, UNBOUNDED, row)

  def put(array, value):
    value = jnp.asarray(value, array.dtype)
    return jnp.where(on_lane, value[:, None] if value.ndim else value, array)

  return dataclasses.replace(
      state,
      status=put(state.status, RUNNING),
      thread=put(state.thread, new_thread),
      token=put(state.token, cfg.vocab.async_open),
      position=put(state.position, state.position[:, 0] + 1),
      horizon=jnp.where(on_lane[..., None], row[:, None, :], state.horizon),
      depth=put(state.depth, 1),
      parent=jnp.where(plan.spawn[:, None] & is_new, 0, state.parent),
      next_thread=state.next_thread + plan.spawn,
  )


def release_sync(state: InterpState, plan: FeedPlan) -> InterpState:
  """At a `<sync/>` feed main sees every fork spawned so far, before attention in this step."""
  spawned = jnp.arange(state.horizon.shape[-1])[None, :] < state.next_thread[:, None]  # [B, U]
  release = (jnp.arange(state.horizon.shape[1]) == 0)[None, :, None] & (plan.sync_release[:, None] & spawned)[:, None]
  return dataclasses.replace(state, horizon=jnp.where(release, UNBOUNDED, state.horizon))


def next_main_position(state: InterpState, plan: FeedPlan, cfg: InterpreterConfig,
                       length_table: jax.Array, spawned_thread: jax.Array) -> jax.Array:
  """p + 1, or p + 1 + R after main's promise (R per position mode)."""
  fed = state.token[:, 0]
  block = schema.block_length(  # oracle: the scripted block's true length (its script is content + </async>)
      cfg.position_mode, lambda: length_table[fed],
      lambda: jnp.take_along_axis(state.script_len, spawned_thread[:, None], axis=1)[:, 0] - 1)
  skip = jnp.where(plan.spawn, reserved_span(block), 0)
  return state.position[:, 0] + 1 + skip


def apply_samples(state: InterpState, plan: FeedPlan, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array, spawned_thread: jax.Array) -> tuple[InterpState, jax.Array]:
  """Sampled tokens [B, T] become pending tokens. Returns the state and which lanes recorded."""
  vocab = cfg.vocab
  lane_idx = jnp.arange(cfg.lanes)
  closing_done = plan.feed & (state.status == CLOSING)
  sampled_ok = plan.feed & ~closing_done  # lanes whose sample is kept
  is_fork = lane_idx > 0
  closes = is_fork & ((sampled == vocab.async_close) | jnp.isin(sampled, jnp.asarray(vocab.eos_ids)))
  token = jnp.where(closes, vocab.async_close, sampled)
  main_pos = next_main_position(state, plan, cfg, length_table, spawned_thread)
  position = jnp.where(is_fork, state.position + 1, main_pos[:, None])
  status = jnp.where(sampled_ok & closes, CLOSING, state.status)
  status = jnp.where(closing_done, FREE, status)
  status = status.at[:, 0].set(jnp.where(plan.main_done, DONE, status[:, 0]))
  main_new = sampled[:, 0]
  in_promise = jnp.where(plan.feed[:, 0], (main_new == vocab.promise) |
                         (state.in_promise & (length_table[main_new] == 0)), state.in_promise)
  finished = (status[:, 0] == DONE) & jnp.all((status == FREE) | ~is_fork, axis=1)
  fed_any = jnp.any(plan.feed, axis=1)
  state = dataclasses.replace(
      state,
      token=jnp.where(sampled_ok, token, state.token),
      position=jnp.where(sampled_ok, position, state.position),
      status=status,
      in_promise=in_promise,
      finished=state.finished | finished,
      truncated=state.truncated | plan.out_of_room,
      pool_full=state.pool_full | plan.out_of_room,
      stalls=state.stalls + plan.stall,
      last_fed_step=jnp.where(fed_any, state.step, state.last_fed_step),
  )
  return state, sampled_ok


@dataclasses.dataclass(frozen=True)
class PastaRules(Rules):
  """PASTA-LANG: main forks at a promise's LENGTH, forks close at `</async>`, main waits at `<sync/>`."""

  name: ClassVar[str] = "pasta"
  # Timing that follows from one shared pool: a new fork feeds its `<async>` in its spawn step, and main's
  # `<sync/>` (or end) may feed in the step a fork writes its `</async>`. The naive interpreter's per-lane
  # rows copy KV between rows, a step each way (`decode.naive.NaivePastaRules` turns both off).
  fork_feeds_at_spawn: ClassVar[bool] = True
  sync_waits_for_closing: ClassVar[bool] = False

  def validate(self, cfg: InterpreterConfig) -> None:
    super().validate(cfg)
    if self.initial_threads != 1:
      raise ValueError("PASTA threads start at promises: initial_threads must be 1 (a fan-out is SotRules)")

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    plan = plan_feeds(state, cfg, length_table)
    spawned_thread = state.next_thread
    state = release_sync(apply_spawn(state, plan, cfg), plan)
    inserted = inserted_rows(state, plan.spawn_lane[:, None])  # the fork's `<async>`, fed this step
    slots = append_slots(plan.feed, state, cfg.pool_slots)
    state = write_slots(state, plan.feed, slots)
    return state, StepFeed(plan.feed, slots, inserted, plan.spawn[:, None], (plan, spawned_thread))

  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig):
    tables = AllowedTokens.build(cfg.vocab, logits.shape[-1])
    allowed = tables.for_rows(rows_lane == 0, state.in_promise[:, None])
    is_length = jnp.asarray(tables.length)
    if cfg.sampling.distinct_topics:  # main may not close a topic it already used (SamplingConfig)
      def read_pool():  # only steps where some main is inside a promise pay for it
        return state.in_promise & repeated_topic(state.slot_token, state.slot_owner, state.slot_order,
                                                 state.slot_valid, cfg.vocab)
      repeat = jax.lax.cond(jnp.any(state.in_promise), read_pool, lambda: jnp.zeros_like(state.in_promise))
      allowed = allowed & ~(((rows_lane == 0) & repeat[:, None])[..., None] & is_length)  # [B, Q, V]
    refused = jnp.zeros(rows_lane.shape, bool)
    if cfg.sampling.caps_topics:  # a row's topic at its cap may only close (SamplingConfig.max_topic_tokens)
      capped = state.in_promise & (state.sampling.max_topic > 0)
      def topic_length():  # only steps where some capped main is inside a promise pay for it
        return open_topic_length(state.slot_token, state.slot_owner, state.slot_order, state.slot_valid, cfg.vocab)
      length = jax.lax.cond(jnp.any(capped), topic_length, lambda: jnp.zeros_like(state.sampling.max_topic))
      at_cap = (rows_lane == 0) & (capped & (length >= state.sampling.max_topic))[:, None]  # [B, Q]
      allowed, refused = cap_topics(allowed, logits, at_cap, is_length)
    return allowed, refused

  def script_end(self, rows_lane: jax.Array, cfg: InterpreterConfig) -> jax.Array:
    return jnp.where(rows_lane == 0, cfg.vocab.eos_ids[0], cfg.vocab.async_close).astype(jnp.int32)

  def after_model(self, state: InterpState, step: StepFeed, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array):
    plan, spawned_thread = step.plan
    return apply_samples(state, plan, sampled, cfg, length_table, spawned_thread)
