"""The naive batched PASTA interpreter of the paper's Appendix B: one KV row per lane.

It exists only to be measured against the interleaved interpreter (`loop.py`, `step.py`). The pool is
`[layers, B*T, S, kv_heads, head_dim]`: row `b*T + t` is lane `t` of request `b` and holds exactly
what that lane's thread may see, so a row's attention mask is just its valid slots (no horizon
table). Every step runs the model on all B*T rows, one query each, inactive rows masked: that
oversized compute and memory is the point of the baseline.

Same contract as docs/interpreter.md (thread table, constraints, sampling, forced scripts, position
modes, stalls, records), with these differences:
- Spawn: when main feeds a promise's LENGTH token, the interpreter copies main's row (prefix incl.
  that token's K/V) into the fork's row after the model call, and the fork feeds `<async>` from the
  next step on. So a fork starts one step later than in the interleaved interpreter (its `<async>`
  is still recorded in the spawn step) and its lane frees one step later.
- A fork's own tokens (`<async>` ... `</async>`) are copied into main's row right after the step
  that writes its `</async>`, then its row is freed (marked invalid). The copy is appended after
  main's current end, not inserted after the promise as in the paper: attention does not depend on
  slot order because positions are already rotated into the keys. The copied slots stay hidden from
  main until its next `<sync/>` feeds. Copying at close (not at sync) is needed because the contract
  frees a fork's lane at its `</async>`; a later fork may reuse the row before main syncs.
- Sync: main's pending `<sync/>` (or end token) waits until no fork is running *or closing*, i.e.
  until every `</async>` is in a row and copied; the `<sync/>` query then sees every fork's tokens.
  (The interleaved interpreter lets `<sync/>` feed in the step the last `</async>` is written.)
- Room: a step that would write more tokens than the pool has slots (counted once per token, as in
  the interleaved pool) truncates. That bounds every row (a row never holds more than the tokens
  written), so S slots per row suffice and both interpreters hold the same number of tokens.
- Steps, lanes and stall counts differ (forks run a step later, lanes free a step later), so a
  tight `max_steps` can stop a naive run earlier. Sampling uses the same per-(request, step, lane)
  keys, but fork steps differ: only greedy or forced runs give the same per-thread tokens, positions
  and logits as the interleaved interpreter. `cfg.lane_buckets` is ignored (all rows always run);
  the thread table's horizon is still updated by `threads.apply_spawn` but never read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp

from pasta_jax.decode import loop
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import RunOutput
from pasta_jax.decode.pool import inserted_rows
from pasta_jax.decode.rules import pasta as threads
from pasta_jax.decode.rules.pasta import PastaRules
from pasta_jax.decode.state import CLOSING, InterpState
from pasta_jax.decode.step import ModelFn, advance_scripts, append_records, choose_tokens, spend_budget
from pasta_jax.errors import PastaError
from pasta_jax.model.gemma import KVPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NaiveState:
  # Thread table, scripts, counters and records, as in the interleaved interpreter. Its interleaved
  # pool fields are one-slot placeholders, except `next_slot`: the number of tokens written so far.
  table: InterpState
  pool: KVPool  # [layers, B*T, S, K, hd]: row b*T + t is lane t of request b
  row_valid: jax.Array  # [B, T, S] bool: the row's thread sees the slot
  row_pos: jax.Array  # [B, T, S] int32 position of each slot
  row_next: jax.Array  # [B, T] int32 append pointer per row
  fork_start: jax.Array  # [B, T] int32 first slot of the fork's own tokens (after the copied prefix)
  unsynced: jax.Array  # [B, S] bool: main-row slots copied from closed forks, visible from the next <sync/>


def naive_kv_bytes(cfg: InterpreterConfig, batch: int, pool_spec: tuple) -> int:
  """K + V bytes of the naive pool: B*T rows of S slots (S = cfg.pool_slots per row)."""
  return interleaved_kv_bytes(cfg, batch, pool_spec) * cfg.lanes


def interleaved_kv_bytes(cfg: InterpreterConfig, batch: int, pool_spec: tuple) -> int:
  """K + V bytes of the interleaved pool: B rows of S slots shared by all lanes."""
  num_layers, kv_heads, head_dim, dtype = pool_spec
  return 2 * num_layers * batch * cfg.pool_slots * kv_heads * head_dim * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class NaivePastaRules(PastaRules):
  """PASTA's rules with the timing of per-lane rows: a new fork feeds from the step after its spawn
  (once main's prefix is copied into its row), and main's `<sync/>` or end also waits for closing
  forks (their KV must be copied into main's row before main may attend to it)."""

  fork_feeds_at_spawn: ClassVar[bool] = False
  sync_waits_for_closing: ClassVar[bool] = True


def reveal_synced(state: NaiveState, plan: threads.FeedPlan) -> NaiveState:
  """At a `<sync/>` feed the copied fork tokens in main's row become visible, before attention."""
  release = plan.sync_release[:, None]
  main_valid = state.row_valid[:, 0] | (state.unsynced & release)
  return dataclasses.replace(state, row_valid=state.row_valid.at[:, 0].set(main_valid),
                             unsynced=state.unsynced & ~release)


def write_row_slots(state: NaiveState, plan: threads.FeedPlan) -> tuple[NaiveState, jax.Array]:
  """Each feeding lane appends to its own row. Returns the state and slots [B, T] (S: no write)."""
  table = state.table
  num_slots = state.row_valid.shape[-1]
  slots = jnp.where(plan.feed, state.row_next, num_slots)
  b = jnp.arange(slots.shape[0])[:, None]
  lane = jnp.arange(slots.shape[1])[None, :]
  state = dataclasses.replace(
      state,
      row_valid=state.row_valid.at[b, lane, slots].set(True, mode="drop"),
      row_pos=state.row_pos.at[b, lane, slots].set(table.position, mode="drop"),
      row_next=state.row_next + plan.feed,
      table=dataclasses.replace(table, next_slot=table.next_slot + plan.feed.sum(axis=1)),
  )
  return state, slots


def model_on_rows(model_fn: ModelFn, params, state: NaiveState, plan: threads.FeedPlan, slots,
                  cfg: InterpreterConfig, forced: bool):
  """One query per row on all B*T rows (non-feeding rows masked out and their writes dropped)."""
  table = state.table
  batch, lanes = plan.feed.shape
  rows, num_slots = batch * lanes, state.row_valid.shape[-1]
  mask = (state.row_valid & plan.feed[..., None]).reshape(rows, 1, num_slots)
  out = model_fn(params, table.token.reshape(rows, 1), table.position.reshape(rows, 1), mask,
                 state.pool, slots.reshape(rows, 1), state.row_pos.reshape(rows, num_slots))
  logits = out.logits.reshape(batch, lanes, -1)  # [B, T, V]
  rows_lane = jnp.broadcast_to(jnp.arange(lanes, dtype=jnp.int32), (batch, lanes))
  sampled = jnp.where(plan.feed, choose_tokens(logits, rows_lane, plan.feed, table, cfg, forced)[1], -1)
  lane_logits = jnp.where(plan.feed[..., None], logits, 0.0) if cfg.record_logits else None
  return sampled, lane_logits, out.kv


def lanes_view(x: jax.Array, batch: int) -> jax.Array:
  """[layers, B*T, S, K, hd] -> [layers, B, T, S, K, hd] (a free reshape)."""
  return x.reshape(x.shape[0], batch, -1, *x.shape[2:])


def copy_prefix_to_forks(state: NaiveState, plan: threads.FeedPlan) -> NaiveState:
  """Spawn: main's whole row (prefix through the LENGTH token just written) -> the fork's row."""
  batch, lanes = state.row_next.shape
  b = jnp.arange(batch)
  lane = jnp.where(plan.spawn, plan.spawn_lane, lanes)  # lanes: no spawn, the write drops

  def copy(x):  # [layers, B*T, S, K, hd]
    rows = lanes_view(x, batch)
    return rows.at[:, b, lane].set(rows[:, :, 0], mode="drop").reshape(x.shape)

  # Unsynced fork tokens in main's row are invalid there, so the fork's copy does not see them.
  pool = jax.lax.cond(jnp.any(plan.spawn), lambda p: jax.tree.map(copy, p), lambda p: p, state.pool)
  main_next = state.row_next[:, 0]
  return dataclasses.replace(
      state, pool=pool,
      row_valid=state.row_valid.at[b, lane].set(state.row_valid[:, 0], mode="drop"),
      row_pos=state.row_pos.at[b, lane].set(state.row_pos[:, 0], mode="drop"),
      row_next=state.row_next.at[b, lane].set(main_next, mode="drop"),
      fork_start=state.fork_start.at[b, lane].set(main_next, mode="drop"))


def closed_sources(state: NaiveState, closing: jax.Array):
  """Where each main-row slot comes from when closing forks [B, T] append their own tokens there.

  Forks' ranges follow each other in lane order after main's end. Returns (copied [B, S] bool,
  source lane [B, S], source slot [B, S], main's new end [B]).
  """
  batch, lanes = closing.shape
  count = jnp.where(closing, state.row_next - state.fork_start, 0)  # [B, T], incl. </async>
  end = state.row_next[:, :1] + jnp.cumsum(count, axis=1)  # [B, T] end of each lane's range in main's row
  j = jnp.arange(state.row_valid.shape[-1])[None, :]  # [1, S]
  lane = jnp.minimum(jnp.sum(end[:, None, :] <= j[:, :, None], axis=-1), lanes - 1)  # [B, S]
  b = jnp.arange(batch)[:, None]
  src = state.fork_start[b, lane] + j - (end[b, lane] - count[b, lane])
  copied = (j >= state.row_next[:, :1]) & (j < end[:, -1:])
  return copied, lane, jnp.clip(src, 0, state.row_valid.shape[-1] - 1), end[:, -1]


def copy_forks_to_main(state: NaiveState, closing: jax.Array) -> NaiveState:
  """Forks that wrote `</async>` this step: own tokens -> main's row (hidden until sync); rows freed."""
  batch = closing.shape[0]
  copied, lane, src, main_end = closed_sources(state, closing)
  b = jnp.arange(batch)[:, None]

  def copy(x):  # [layers, B*T, S, K, hd]
    rows = lanes_view(x, batch)
    main = jnp.where(copied[None, :, :, None, None], rows[:, b, lane, src], rows[:, :, 0])
    return rows.at[:, :, 0].set(main).reshape(x.shape)

  pool = jax.lax.cond(jnp.any(closing), lambda p: jax.tree.map(copy, p), lambda p: p, state.pool)
  main_pos = jnp.where(copied, state.row_pos[b, lane, src], state.row_pos[:, 0])
  return dataclasses.replace(
      state, pool=pool,
      row_pos=state.row_pos.at[:, 0].set(main_pos),
      row_valid=state.row_valid & ~closing[..., None],
      row_next=jnp.where(closing, 0, state.row_next).at[:, 0].set(main_end),
      fork_start=jnp.where(closing, 0, state.fork_start),
      unsynced=state.unsynced | copied)


def naive_step(model_fn, params, state: NaiveState, cfg: InterpreterConfig, length_table,
               forced: bool) -> NaiveState:
  table = dataclasses.replace(state.table, step=state.table.step + 1)
  plan = threads.plan_feeds(table, cfg, length_table)
  closing = plan.feed & (table.status == CLOSING)  # these write `</async>` this step
  spawned_thread = table.next_thread
  table = threads.apply_spawn(table, plan, cfg)  # fork lane: `<async>` pending, fed from the next step
  spawn_row = inserted_rows(table, plan.spawn_lane[:, None]), plan.spawn[:, None]
  state = reveal_synced(dataclasses.replace(state, table=table), plan)
  state, slots = write_row_slots(state, plan)
  sampled, lane_logits, pool = model_on_rows(model_fn, params, state, plan, slots, cfg, forced)
  state = dataclasses.replace(state, pool=pool)
  table = advance_scripts(state.table, plan.feed, cfg) if forced else state.table
  table, recorded = threads.apply_samples(table, plan, sampled, cfg, length_table, spawned_thread)
  table = spend_budget(append_records(table, spawn_row, recorded, lane_logits, cfg), recorded, cfg)
  state = copy_prefix_to_forks(state, plan)  # before the closes: a new fork must not get their slots
  return dataclasses.replace(copy_forks_to_main(state, closing), table=table)


def init_naive(main_pool: KVPool, valid, table: InterpState, cfg: InterpreterConfig) -> NaiveState:
  """Main's rows hold the prompt; every other row is empty."""
  batch, num_slots = valid.shape
  lanes = cfg.lanes

  def rows(x):  # [layers, B, S, K, hd] -> [layers, B*T, S, K, hd], main on lane 0
    full = jnp.zeros((x.shape[0], batch, lanes) + x.shape[2:], x.dtype).at[:, :, 0].set(x)
    return full.reshape(x.shape[0], batch * lanes, *x.shape[2:])

  placeholder = jnp.zeros((batch, 1), jnp.int32)  # the interleaved pool's metadata, unused here
  table = dataclasses.replace(table, pool=KVPool(jnp.zeros((1,)), jnp.zeros((1,))), slot_owner=placeholder,
                              slot_order=placeholder, slot_pos=placeholder, slot_token=placeholder,
                              slot_valid=placeholder > 0)
  slot_idx = jnp.arange(num_slots, dtype=jnp.int32)
  return NaiveState(
      table=table, pool=jax.tree.map(rows, main_pool),
      row_valid=jnp.zeros((batch, lanes, num_slots), bool).at[:, 0].set(valid),
      row_pos=jnp.broadcast_to(slot_idx, (batch, lanes, num_slots)),
      row_next=jnp.zeros((batch, lanes), jnp.int32).at[:, 0].set(table.next_slot),
      fork_start=jnp.zeros((batch, lanes), jnp.int32),
      unsynced=jnp.zeros((batch, num_slots), bool))


@functools.partial(jax.jit, static_argnames=("model_fn", "cfg", "forced", "vocab_size", "pool_spec"))
def naive_prefill_and_run(model_fn, params, prompt_tokens, lengths, script, script_len, sampling, rule_inputs=None,
                          *,
                          cfg: InterpreterConfig, forced: bool, vocab_size: int, pool_spec: tuple):
  """Prefill main's rows, sample main's first token (step 0), then the whole loop on device.
  Returns the final thread table (an InterpState) for `loop.unpack`."""
  if type(cfg.rules) is not PastaRules:
    raise PastaError(f"the naive interpreter is PASTA's Appendix-B baseline; it cannot run {cfg.rules.name} rules")
  if cfg.certify_head:  # its step multiplies the head inside the model
    raise PastaError("the naive interpreter has no certified head: use the interleaved one")
  if cfg.sampling.penalizes:  # its per-lane rows keep no pool metadata to read what a row sees
    raise PastaError("the naive interpreter has no repetition penalty: use the interleaved one")
  if cfg.sampling.distinct_topics:  # the same: it reads main's topics from the pool's metadata
    raise PastaError("the naive interpreter has no distinct_topics rule: use the interleaved one")
  cfg = dataclasses.replace(cfg, rules=NaivePastaRules(**{f.name: getattr(cfg.rules, f.name)
                                                          for f in dataclasses.fields(cfg.rules)}))
  loop.check_runnable(cfg, forced)
  last, main_pool = loop.prefill(model_fn, params, prompt_tokens, lengths, cfg.pool_slots, pool_spec)
  valid = jnp.arange(cfg.pool_slots)[None, :] < lengths[:, None]
  table = loop.initial_state(None, last, prompt_tokens, lengths, script, script_len, sampling, cfg, forced,
                             vocab_size)
  length_table = jnp.asarray(cfg.vocab.length_table(vocab_size))

  def cond(s: NaiveState):
    return (s.table.step < cfg.max_steps) & jnp.any(s.table.live)

  def body(s: NaiveState):
    return naive_step(model_fn, params, s, cfg, length_table, forced)

  final = jax.lax.while_loop(cond, body, init_naive(main_pool, valid, table, cfg)).table
  return dataclasses.replace(final, truncated=final.truncated | ~final.finished)


def run_naive(model_fn: ModelFn, params, prompts: Sequence[Sequence[int]], cfg: InterpreterConfig, *,
              vocab_size: int, pool_spec: tuple, scripts=None) -> list[RunOutput]:
  """Runs B prompts through the naive interpreter; same arguments and outputs as `run_interpreter`.

  pool_spec = (num_layers, kv_heads, head_dim, dtype); every lane gets a row of cfg.pool_slots.
  `cfg.lane_buckets` is ignored: the naive interpreter always computes all B*T rows.
  """
  tokens, lengths = loop.pad_prompts(prompts, cfg.pool_slots)
  script, script_len = loop.pad_scripts(scripts, len(prompts), cfg.max_threads)
  final = naive_prefill_and_run(model_fn, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                jnp.asarray(script), jnp.asarray(script_len),
                                loop.row_sampling(cfg.sampling, len(prompts)),
                                cfg=loop.static_config(cfg), forced=scripts is not None,
                                vocab_size=vocab_size, pool_spec=pool_spec)
  return loop.unpack(final, cfg)
