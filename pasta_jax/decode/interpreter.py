"""The jitted PASTA interpreter: one `lax.while_loop` over B requests x T lanes and one
interleaved KV pool (docs/interpreter.md is the contract; `reference/` is its oracle).

Each step: decide who feeds (threads.plan_feeds), spawn and release syncs in the thread table,
give the feeding lanes consecutive pool slots, run the model once on only the feeding lanes
(a `lax.switch` over lane-count buckets 1, 2, 4, ...), sample under tag constraints (or read the
forced script), then apply the thread transitions. The host sees only the final state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import apar, threads
from pasta_jax.decode.constraints import AllowedTokens, constrain
from pasta_jax.decode.plain import ModelFn, bucket
from pasta_jax.decode.sampling import lane_key, sample_rows
from pasta_jax.decode.state import FREE, RUNNING, InterpreterConfig, InterpState
from pasta_jax.errors import PastaError
from pasta_jax.model.gemma import KVPool
from pasta_jax.visibility import HIDDEN, UNBOUNDED, visible


def init_state(pool: KVPool, prompt_len: int, lengths: jax.Array, first: jax.Array, script, script_len,
               cfg: InterpreterConfig, vocab_size: int, main_script_ptr: int, key: jax.Array) -> InterpState:
  """State after prefill: prompt b in slots 0..len_b-1, main pending its first token.

  With `initial_threads` k > 1 (APAR fan-out), threads 1..k-1 also start, on lanes 1..k-1: each
  sees the prompt and itself, sits at the prompt's end, and has its script's first token pending.
  """
  batch = lengths.shape[0]
  b_t = (batch, cfg.lanes)
  slot_idx = jnp.arange(cfg.pool_slots)
  lane_idx = jnp.arange(cfg.lanes)[None, :]
  k = cfg.initial_threads
  started = lane_idx < k
  threads = jnp.arange(cfg.max_threads)
  own = threads[None, None, :] == jnp.arange(cfg.lanes)[None, :, None]  # [1, T, U]
  prompt_view = jnp.where(threads == 0, (lengths - 1)[:, None, None], HIDDEN)  # [B, 1, U]
  horizon = jnp.where(own & started[..., None], UNBOUNDED,
                      jnp.where(started[..., None], prompt_view, HIDDEN)).astype(jnp.int32)
  fan_first = script[:, jnp.minimum(jnp.arange(cfg.lanes), cfg.max_threads - 1), 0]  # [B, T]
  token = jnp.where(lane_idx == 0, first[:, None], jnp.where(started, fan_first, 0)).astype(jnp.int32)
  num_rec = cfg.max_records
  records = jnp.zeros((batch, num_rec, 5), jnp.int32)
  lanes = jnp.broadcast_to(jnp.arange(k), (batch, k))
  first_rows = jnp.stack([jnp.zeros_like(lanes), lanes, lanes, token[:, :k],
                          jnp.broadcast_to(lengths[:, None], (batch, k))], axis=2)
  records = records.at[:, :k].set(first_rows)
  rec_logits = jnp.zeros((batch, num_rec if cfg.record_logits else 1, vocab_size if cfg.record_logits else 1))
  script_ptr = jnp.zeros((batch, cfg.max_threads), jnp.int32).at[:, 0].set(main_script_ptr)
  script_ptr = script_ptr.at[:, 1:k].set(1)
  return InterpState(
      pool=pool,
      slot_owner=jnp.zeros((batch, cfg.pool_slots), jnp.int32),
      slot_order=jnp.broadcast_to(slot_idx, (batch, cfg.pool_slots)).astype(jnp.int32),
      slot_pos=jnp.broadcast_to(slot_idx, (batch, cfg.pool_slots)).astype(jnp.int32),
      slot_valid=slot_idx[None, :] < lengths[:, None],
      next_slot=lengths.astype(jnp.int32),
      peak_live=lengths.astype(jnp.int32),
      status=jnp.broadcast_to(jnp.where(started, RUNNING, FREE), b_t).astype(jnp.int32),
      thread=jnp.broadcast_to(jnp.where(started, lane_idx, 0), b_t).astype(jnp.int32),
      token=token,
      position=jnp.where(started, lengths[:, None], 0).astype(jnp.int32),
      horizon=horizon,
      in_promise=first == cfg.vocab.promise,
      next_thread=jnp.full((batch,), k, jnp.int32),
      depth=jnp.broadcast_to(jnp.where(started & (lane_idx > 0), 1, 0), b_t).astype(jnp.int32),
      parent=jnp.full((batch, cfg.max_threads), -1, jnp.int32).at[:, 1:k].set(0),
      script=script, script_len=script_len, script_ptr=script_ptr,
      finished=jnp.zeros((batch,), bool), truncated=jnp.zeros((batch,), bool), pool_full=jnp.zeros((batch,), bool),
      stalls=jnp.zeros((batch,), jnp.int32), fork_refusals=jnp.zeros((batch,), jnp.int32),
      last_fed_step=jnp.zeros((batch,), jnp.int32),
      step=jnp.int32(0), records=records, num_records=jnp.full((batch,), k, jnp.int32),
      record_logits=rec_logits, key=key,
  )


def choose_tokens(logits, rows_lane, state: InterpState, cfg: InterpreterConfig, forced: bool):
  """Constrained sample (or forced script token) for each query row. logits: [B, Q, V].
  Returns tokens [B, Q] and which rows had a fork refused by a limit (`sample_constrained`)."""
  batch, num_q, _ = logits.shape
  b = jnp.arange(batch)[:, None]
  thread = state.thread[b, rows_lane]
  if forced:
    ptr = state.script_ptr[b, thread]
    scripted = jnp.take_along_axis(state.script[b, thread], jnp.minimum(ptr, state.script.shape[-1] - 1)[..., None],
                                   axis=-1)[..., 0]
    fallback = jnp.where((rows_lane == 0) | (cfg.mode == "apar"), cfg.vocab.eos_ids[0], cfg.vocab.async_close)
    forced_token = jnp.where(ptr < state.script_len[b, thread], scripted, fallback)
    # The model still runs: without a use of the logits XLA would drop the output head, and forced
    # replays (the benchmarks' workload) would time a model without its most expensive matmul.
    model_choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not cfg.sample_after_script:
      return jnp.where(model_choice < 0, model_choice, forced_token), jnp.zeros_like(forced_token, bool)
    sampled, refused = sample_constrained(logits, rows_lane, state, cfg)
    scripted_now = ptr < state.script_len[b, thread]
    return jnp.where(scripted_now, scripted, sampled), refused & ~scripted_now
  return sample_constrained(logits, rows_lane, state, cfg)


def sample_constrained(logits, rows_lane, state: InterpState, cfg: InterpreterConfig):
  """Sampled tokens [B, Q] under the tag constraints of each row's thread, and [B, Q] refused forks.

  APAR forbids a fork at the depth limit or while no lane is free. Such a row counts as a refused fork
  when [Fork] is its most likely token under the grammar alone (not right after a fork or child token):
  what greedy decoding would have written. The sampled token itself is unchanged by the count."""
  batch, num_q, _ = logits.shape
  b = jnp.arange(batch)[:, None]
  tables = AllowedTokens.build(cfg.vocab, logits.shape[-1])
  if cfg.mode == "apar":
    fed = state.token[b, rows_lane]
    grammar_no_fork = (fed == cfg.vocab.apar_fork) | (fed == cfg.vocab.apar_child)
    limited = (state.depth[b, rows_lane] >= cfg.max_depth) | ~apar.lane_free(state)[:, None]
    allowed = tables.for_apar_rows(grammar_no_fork | limited)
    top = jnp.argmax(constrain(logits, tables.for_apar_rows(grammar_no_fork)), axis=-1)
    refused = limited & ~grammar_no_fork & (top == cfg.vocab.apar_fork)
  else:
    allowed = tables.for_rows(rows_lane == 0, state.in_promise[:, None])
    refused = jnp.zeros(rows_lane.shape, bool)
  keys = jax.vmap(lambda bi, lanes: jax.vmap(lambda lane: lane_key(state.key, bi, state.step, lane))(lanes))(
      jnp.arange(batch), rows_lane)
  flat = sample_rows(constrain(logits, allowed).reshape(batch * num_q, -1), keys.reshape(-1), cfg.sampling)
  return flat.reshape(batch, num_q), refused


def run_rows(model_fn: ModelFn, params, state: InterpState, feed, slots, cfg: InterpreterConfig,
             num_q: int, forced: bool):
  """Runs the model on the first `num_q` feeding lanes of each request; returns per-lane tokens."""
  batch = feed.shape[0]
  b = jnp.arange(batch)[:, None]
  rows_lane = jnp.argsort(~feed, axis=1, stable=True)[:, :num_q].astype(jnp.int32)  # feeders first
  row_ok = feed[b, rows_lane]
  mask = visible(state.horizon[b, rows_lane], state.slot_owner, state.slot_order, state.slot_valid)
  mask = mask & row_ok[:, :, None]
  logits, pool = model_fn(params, state.token[b, rows_lane], state.position[b, rows_lane], mask, state.pool,
                          jnp.where(row_ok, slots[b, rows_lane], cfg.pool_slots), state.slot_pos)
  chosen, refused = choose_tokens(logits, rows_lane, state, cfg, forced)
  scatter_lane = jnp.where(row_ok, rows_lane, cfg.lanes)  # padding rows are dropped
  sampled = jnp.full((batch, cfg.lanes), -1, jnp.int32).at[b, scatter_lane].set(chosen, mode="drop")
  refused = jnp.zeros((batch, cfg.lanes), bool).at[b, scatter_lane].set(refused, mode="drop")
  lane_logits = None
  if cfg.record_logits:
    lane_logits = jnp.zeros((batch, cfg.lanes, logits.shape[-1])).at[b, scatter_lane].set(logits, mode="drop")
  return sampled, refused, lane_logits, pool


def model_on_feeders(model_fn, params, state, feed, slots, cfg: InterpreterConfig, forced: bool):
  """Lane-count buckets: one compiled branch per Q in 1, 2, 4, ..., T; the step picks the smallest."""
  sizes = [1 << i for i in range((cfg.lanes - 1).bit_length())] + [cfg.lanes]
  sizes = sorted(set(sizes)) if cfg.lane_buckets else [cfg.lanes]
  branches = [functools.partial(run_rows, model_fn, params, num_q=q, forced=forced, cfg=cfg) for q in sizes]
  if len(branches) == 1:
    return branches[0](state, feed, slots)
  need = jnp.max(feed.sum(axis=1))
  index = jnp.searchsorted(jnp.asarray(sizes), need).astype(jnp.int32)
  return jax.lax.switch(jnp.minimum(index, len(sizes) - 1), branches, state, feed, slots)


def spawn_record(state: InterpState, plan: threads.FeedPlan) -> tuple[jax.Array, jax.Array]:
  """[B, 1, 5] record of the `<async>` the interpreter inserts on the spawn lane, and [B, 1] keep."""
  b = jnp.arange(state.token.shape[0])
  lane = plan.spawn_lane
  row = jnp.stack([jnp.full_like(lane, state.step), lane, state.thread[b, lane], state.token[b, lane],
                   state.position[b, lane]], axis=1)
  return row[:, None], plan.spawn[:, None]


def append_records(state: InterpState, inserted, recorded, lane_logits, cfg) -> InterpState:
  """Appends this step's records: the inserted tokens (`<async>` / APAR_CHILD of spawns, in lane
  order), then the lanes' new pending tokens in lane order. inserted: ([B, K, 5] rows, [B, K] keep)."""
  batch = recorded.shape[0]
  b = jnp.arange(batch)
  lanes = jnp.broadcast_to(jnp.arange(cfg.lanes), (batch, cfg.lanes))
  lane_rows = jnp.stack([jnp.full((batch, cfg.lanes), state.step), lanes, state.thread, state.token,
                         state.position], axis=2)
  spawn_rows, spawn_keep = inserted
  rows = jnp.concatenate([spawn_rows, lane_rows], axis=1)  # [B, K + T, 5]
  keep = jnp.concatenate([spawn_keep, recorded], axis=1)
  index = jnp.where(keep, state.num_records[:, None] + jnp.cumsum(keep, axis=1) - 1, cfg.max_records)
  records = state.records.at[b[:, None], index].set(rows, mode="drop")
  rec_logits = state.record_logits
  if cfg.record_logits:
    rec_logits = rec_logits.at[b[:, None], index[:, spawn_keep.shape[1]:]].set(lane_logits, mode="drop")
  return dataclasses.replace(state, records=records, num_records=state.num_records + keep.sum(axis=1),
                             record_logits=rec_logits)


def interpreter_step(model_fn, params, state: InterpState, cfg: InterpreterConfig, length_table,
                     forced: bool) -> InterpState:
  state = dataclasses.replace(state, step=state.step + 1)
  if cfg.mode == "apar":
    return apar_step(model_fn, params, state, cfg, forced)
  plan = threads.plan_feeds(state, cfg, length_table)
  spawned_thread = state.next_thread
  state = threads.apply_spawn(state, plan, cfg)
  state = threads.release_sync(state, plan)
  inserted = spawn_record(state, plan)
  state, slots = threads.assign_slots(state, plan, cfg)
  sampled, _, lane_logits, pool = model_on_feeders(model_fn, params, state, plan.feed, slots, cfg, forced)
  state = dataclasses.replace(state, pool=pool)
  if forced:
    state = threads.advance_scripts(state, plan, cfg)
  state, recorded = threads.apply_samples(state, plan, sampled, cfg, length_table, spawned_thread)
  return append_records(state, inserted, recorded, lane_logits, cfg)


def apar_step(model_fn, params, state: InterpState, cfg: InterpreterConfig, forced: bool) -> InterpState:
  """One APAR step: the same model step and records, with APAR's transitions (decode/apar.py)."""
  plan = apar.plan_apar(state, cfg)
  state = apar.apply_spawn(state, plan, cfg)
  inserted = apar.spawn_records(state, plan)
  state = apar.assign_slots(state, plan)
  sampled, refused, lane_logits, pool = model_on_feeders(model_fn, params, state, plan.feed, plan.slots, cfg, forced)
  state = dataclasses.replace(state, pool=pool, fork_refusals=state.fork_refusals + refused.sum(axis=1))
  if forced:
    state = threads.advance_scripts(state, plan, cfg)
  state, recorded = apar.apply_samples(state, plan, sampled, cfg)
  return append_records(state, inserted, recorded, lane_logits, cfg)


def check_runnable(cfg: InterpreterConfig, forced: bool) -> None:
  """Refuses settings the loop cannot honour. The oracle position mode reserves each block's true length,
  which only a forced script knows: in free (or sampled-after-script) decoding there is none, and main's
  next position would silently fall at p + 2 (a length of -1)."""
  if cfg.position_mode == "oracle" and (not forced or cfg.sample_after_script):
    raise PastaError("position_mode='oracle' needs every block's true length, which only forced replay knows: "
                     "use 'pred' or 'fixed' in free decoding")


@functools.partial(jax.jit, static_argnames=("model_fn", "cfg", "forced", "vocab_size", "pool_spec"))
def prefill_and_run(model_fn, params, prompt_tokens, lengths, script, script_len, seed, *, cfg: InterpreterConfig,
                    forced: bool, vocab_size: int, pool_spec: tuple) -> InterpState:
  """Prefill (one model call over the padded prompts [B, P]) then the whole decode loop on device."""
  check_runnable(cfg, forced)
  batch, prompt_len = prompt_tokens.shape
  num_layers, kv_heads, head_dim, dtype = pool_spec
  pool = KVPool(*(jnp.zeros((num_layers, batch, cfg.pool_slots, kv_heads, head_dim), dtype),) * 2)
  idx = jnp.arange(prompt_len)
  positions = jnp.broadcast_to(idx, (batch, prompt_len)).astype(jnp.int32)
  horizon = jnp.where(jnp.arange(cfg.max_threads) == 0, idx[:, None], HIDDEN)  # [P, U]: causal main
  slot_valid = jnp.arange(cfg.pool_slots)[None, :] < lengths[:, None]
  slot_idx = jnp.broadcast_to(jnp.arange(cfg.pool_slots), (batch, cfg.pool_slots)).astype(jnp.int32)
  mask = visible(jnp.broadcast_to(horizon, (batch,) + horizon.shape), jnp.zeros_like(slot_idx), slot_idx,
                 slot_valid)
  # Padding rows are dropped (slot S), so each request's decode writes start right at its length.
  prefill_slots = jnp.where(idx[None, :] < lengths[:, None], positions, cfg.pool_slots)
  logits, pool = model_fn(params, prompt_tokens, positions, mask, pool, prefill_slots, slot_idx)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)  # [B, 1, V]
  key = jax.random.key(seed)
  state = init_state(pool, prompt_len, lengths, jnp.zeros_like(lengths), script, script_len, cfg, vocab_size, 0, key)
  first = choose_tokens(last, jnp.zeros((batch, 1), jnp.int32), state, cfg, forced)[0][:, 0]
  state = init_state(pool, prompt_len, lengths, first, script, script_len, cfg, vocab_size, 1, key)
  if cfg.record_logits:
    state = dataclasses.replace(state, record_logits=state.record_logits.at[:, 0].set(last[:, 0]))
  length_table = jnp.asarray(cfg.vocab.length_table(vocab_size))

  def cond(s: InterpState):
    return (s.step < cfg.max_steps) & jnp.any(s.live)

  def body(s: InterpState):
    return interpreter_step(model_fn, params, s, cfg, length_table, forced)

  final = jax.lax.while_loop(cond, body, state)
  return dataclasses.replace(final, truncated=final.truncated | ~final.finished)


@dataclasses.dataclass(frozen=True)
class RunOutput:
  """Host-side result of one request: records and counters (see docs/interpreter.md)."""

  records: np.ndarray  # [N, 5] (step, lane, thread, token, position)
  logits: np.ndarray | None  # [N, V] aligned with records (zeros for inserted `<async>`)
  steps: int
  stalls: int
  finished: bool
  truncated: bool
  pool_full: bool = False  # truncated because the pool had no room (not by the step budget)
  fork_refusals: int = 0  # APAR: forks the depth limit or a full lane table refused (sample_constrained)
  peak_live_slots: int = 0  # most pool slots valid at once (the prompt included)
  parents: np.ndarray | None = None  # [U] the thread that spawned each thread (-1: main / never spawned)
  slot_table: np.ndarray | None = None  # [S, 4] final (owner, write order, position, valid) per pool slot


def pad_scripts(scripts: Sequence[Sequence[Sequence[int]]] | None, batch: int, max_threads: int):
  """Per-request, per-thread scripts -> [B, U, L] tokens and [B, U] lengths."""
  if scripts is None:
    return np.zeros((batch, max_threads, 1), np.int32), np.zeros((batch, max_threads), np.int32)
  if len(scripts) != batch:
    raise PastaError(f"got {len(scripts)} scripts for {batch} prompts")
  # Threads past max_threads can never spawn (main stalls on them until the step budget ends the
  # request as truncated), so their scripts are never read.
  scripts = [list(s)[:max_threads] for s in scripts]
  length = bucket(max(1, max(len(t) for s in scripts for t in s)))  # bucketed: few compiled shapes
  tokens = np.zeros((batch, max_threads, length), np.int32)
  lens = np.zeros((batch, max_threads), np.int32)
  for b, per_thread in enumerate(scripts):
    for u, toks in enumerate(per_thread):
      tokens[b, u, : len(toks)] = toks
      lens[b, u] = len(toks)
  return tokens, lens


def pad_prompts(prompts: Sequence[Sequence[int]], pool_slots: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompts -> tokens [B, P] (P bucketed to a power of two) and lengths [B], with clear errors."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise PastaError("empty prompt: give at least one token of prompt")
  longest = max(len(p) for p in prompts)
  prompt_len = bucket(longest)
  if prompt_len > pool_slots:
    raise PastaError(f"a prompt of {longest} tokens (padded to {prompt_len}) does not fit a pool of "
                     f"{pool_slots} slots")
  tokens = np.zeros((len(prompts), prompt_len), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


def static_config(cfg: InterpreterConfig) -> InterpreterConfig:
  """The jit-static part of a config: the seed travels as a traced value, so a new seed reuses the loop."""
  return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, seed=0))


def run_interpreter(model_fn: ModelFn, params, prompts: Sequence[Sequence[int]], cfg: InterpreterConfig, *,
                    vocab_size: int, pool_spec: tuple, scripts=None) -> list[RunOutput]:
  """Runs B prompts through the jitted interpreter; `scripts` (per request, per thread) forces tokens."""
  tokens, lengths = pad_prompts(prompts, cfg.pool_slots)
  script, script_len = pad_scripts(scripts, len(prompts), cfg.max_threads)
  final = prefill_and_run(model_fn, params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(script),
                          jnp.asarray(script_len), jnp.uint32(cfg.sampling.seed), cfg=static_config(cfg),
                          forced=scripts is not None, vocab_size=vocab_size, pool_spec=pool_spec)
  return unpack(final, cfg)


def unpack(final: InterpState, cfg: InterpreterConfig) -> list[RunOutput]:
  final = jax.device_get(final)
  outputs = []
  for b in range(final.records.shape[0]):
    n = int(final.num_records[b])
    outputs.append(RunOutput(
        records=np.asarray(final.records[b, :n]),
        logits=np.asarray(final.record_logits[b, :n]) if cfg.record_logits else None,
        steps=int(final.last_fed_step[b]), stalls=int(final.stalls[b]), fork_refusals=int(final.fork_refusals[b]),
        finished=bool(final.finished[b]), truncated=bool(final.truncated[b]), pool_full=bool(final.pool_full[b]),
        peak_live_slots=int(final.peak_live[b]), parents=np.asarray(final.parent[b]),
        slot_table=np.stack([np.asarray(final.slot_owner[b]), np.asarray(final.slot_order[b]),
                             np.asarray(final.slot_pos[b]), np.asarray(final.slot_valid[b], np.int32)], axis=1)))
  return outputs
