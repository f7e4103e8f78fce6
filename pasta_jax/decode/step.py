"""The one decode step, shared by every method: its rules (`cfg.rules`, decode/rules/) say what differs.

  rules.before_model -> the model on the feeding lanes only, fed rules.feed_inputs (a `lax.switch`
  over lane-count buckets 1, 2, 4, ..., under the one visibility rule) -> rules.select_tokens (a sample
  under rules.allowed by default), or read the forced script -> rules.after_model -> records -> the
  content-token budget (`spend_budget`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pasta_jax.decode import certified_head
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.constraints import bias_fork_open, language_ids
from pasta_jax.decode.rules.base import bucket_index, lane_buckets
from pasta_jax.decode.sampling import first_max_index, penalize_repeats
from pasta_jax.decode.state import CLOSING, InterpState
from pasta_jax.model.gemma import KVPool
from pasta_jax.model.kv_rows import FreshKV, defer_by_default, write_fresh
from pasta_jax.model.output import ModelOutput
from pasta_jax.visibility import HIDDEN, ThreadMask, visible

# (params, tokens, positions, mask, pool, slots, kv_positions, *, token_weights=, logit_rows=, defer_writes=,
#  and the rules' model_extras) -> model/output.ModelOutput: logits (or head_input), kv: the pool written or, with
#  defer_writes, the new K/V rows (model/kv_rows.FreshKV)
ModelFn = Callable[..., ModelOutput]


def seen_tokens(state: InterpState, rows_lane: jax.Array, vocab_size: int, vocab) -> jax.Array:
  """[B, Q, V] bool: the tokens each query row sees in the pool (the one visibility rule over its lane's
  horizons), tags and end ids left out: they are the interpreter's language, not repeated text."""
  b = jnp.arange(rows_lane.shape[0])[:, None]
  sees = visible(state.horizon[b, rows_lane], state.slot_owner, state.slot_order, state.slot_valid)  # [B, Q, S]
  tokens = jnp.where(sees, state.slot_token[:, None, :], vocab_size)  # unseen slots scatter nowhere
  batch, num_q, _ = sees.shape
  seen = jnp.zeros((batch, num_q, vocab_size), bool).at[
      jnp.arange(batch)[:, None, None], jnp.arange(num_q)[None, :, None], tokens].set(True, mode="drop")
  return seen.at[:, :, language_ids(vocab)].set(False, mode="drop")


def choose_tokens(logits, rows_lane, row_ok, state: InterpState, cfg: InterpreterConfig, forced: bool,
                  model_out: ModelOutput | None = None):
  """The token of each query row: the rules' choice (`rules.select_tokens`), or the forced script's.
  logits: [B, Q, V]; model_out: the step's model output, its K/V left out, with what else the rules asked the
  model for (`rules.model_extras`); None at prefill.
  A repetition penalty (`cfg.sampling`) first lowers the logits of what each row already sees; a fork bias then
  moves the promise-open logit (`constraints.bias_fork_open`).
  Returns (state, tokens [B, Q], [B, Q] rows whose most likely token a limit refused)."""
  if cfg.sampling.penalizes and (not forced or cfg.rules.sample_after_script):  # wherever the rules sample
    penalty = state.sampling.penalty  # [B]: each row's (1: off); a step where no row penalizes skips the work
    def penalized(logits):
      seen = seen_tokens(state, rows_lane, logits.shape[-1], cfg.vocab)
      return penalize_repeats(logits, seen, penalty[:, None, None].astype(logits.dtype))
    logits = jax.lax.cond(jnp.any(penalty != 1.0), penalized, lambda x: x, logits)
  if cfg.sampling.biases_forks and (not forced or cfg.rules.sample_after_script):  # PASTA's knob (SamplingConfig)
    logits = bias_fork_open(logits, state.sampling.fork_bias, cfg.vocab)
  if not forced:
    return cfg.rules.select_tokens(state, rows_lane, row_ok, logits, cfg, model_out=model_out)
  b = jnp.arange(logits.shape[0])[:, None]
  thread = state.thread[b, rows_lane]
  ptr = state.script_ptr[b, thread]
  scripted_now = ptr < state.script_len[b, thread]
  scripted = jnp.take_along_axis(state.script[b, thread], jnp.minimum(ptr, state.script.shape[-1] - 1)[..., None],
                                 axis=-1)[..., 0]
  if cfg.rules.sample_after_script:
    state, sampled, refused = cfg.rules.select_tokens(state, rows_lane, row_ok, logits, cfg, model_out=model_out)
    return state, jnp.where(scripted_now, scripted, sampled), refused & ~scripted_now
  forced_token = jnp.where(scripted_now, scripted, cfg.rules.script_end(rows_lane, cfg))
  # The model still runs: without a use of the logits XLA would drop the output head, and forced
  # replays (the benchmarks' workload) would time a model without its most expensive matmul.
  model_choice = first_max_index(logits)
  return state, jnp.where(model_choice < 0, model_choice, forced_token), jnp.zeros_like(forced_token, bool)


def choice_input(out: ModelOutput, skip_head: bool) -> jax.Array:
  """What choosing starts from: the logits [B, Q, V]; or, for a model called with skip_head (a certified head),
  the final-normed hidden states [B, Q, D], whose head `choose_from_model` multiplies."""
  return out.head_input if skip_head else out.logits


def choose_from_model(params, from_model, rows_lane, row_ok, state: InterpState, cfg: InterpreterConfig,
                      forced: bool, model_out: ModelOutput | None = None):
  """`choose_tokens` on the model's `choice_input`: its logits [B, Q, V]; or, with `cfg.certify_head`, its
  final-normed hidden states [B, Q, D], whose head the step multiplies itself (decode/certified_head.py): the
  narrow head's mixed logits, and where a row's choice is not certified, every row again from the float32
  head (the same choice the float32 model makes). Returns (state, tokens [B, Q], refused [B, Q], logits)."""
  if not cfg.certify_head:
    return (*choose_tokens(from_model, rows_lane, row_ok, state, cfg, forced, model_out), from_model)
  # Choosing never reads the KV pool; left in the state, the fallback's cond would copy it (tens of MB) each step.
  pool, state = state.pool, dataclasses.replace(state, pool=None)
  state, tokens, refused, logits = _choose_certified(params, from_model, rows_lane, row_ok, state, cfg, forced,
                                                     model_out)
  return dataclasses.replace(state, pool=pool), tokens, refused, logits


def _choose_certified(params, hidden, rows_lane, row_ok, state: InterpState, cfg: InterpreterConfig,
                      forced: bool, model_out):
  """choose_from_model's certified head. Its logits out are None: they are bounds, and no one records them."""
  def again():
    exact = certified_head.exact_logits(params, hidden, cfg.final_softcap, plan=cfg.head_plan)
    return choose_tokens(exact, rows_lane, row_ok, state, cfg, forced, model_out)

  if forced and cfg.rules.sample_after_script:  # scripted rows would fail the certificate: plain float32
    return (*again(), None)
  logits, ids = certified_head.head_logits(params, hidden, cfg.final_softcap, plan=cfg.head_plan)
  chosen = choose_tokens(logits, rows_lane, row_ok, state, cfg, forced, model_out)
  if forced or ids is None:  # the scripts choose (the head only has to run); or the float32 head chose
    return (*chosen, None)
  held = certified_head.certified_requests(chosen[1], ids, row_ok)  # [B]
  state, tokens, refused = jax.lax.cond(jnp.all(held), lambda: chosen, again)
  state = dataclasses.replace(state, head_fallbacks=state.head_fallbacks + (~held).astype(jnp.int32))
  return state, tokens, refused, None


def run_rows(model_fn: ModelFn, params, state: InterpState, feed, slots, cfg: InterpreterConfig,
             num_q: int, forced: bool, defer: bool = False):
  """Runs the model on the first `num_q` feeding lanes of each request; returns per-lane tokens, the pool
  updated, or with `defer` the pool only read and the new K/V rows by lane (`lane_rows`) in its place, and what
  choosing changed in the state: (rule_state, head_fallbacks)."""
  batch = feed.shape[0]
  b = jnp.arange(batch)[:, None]
  rows_lane = jnp.argsort(~feed, axis=1, stable=True)[:, :num_q].astype(jnp.int32)  # feeders first
  row_ok = feed[b, rows_lane]
  # Padding rows see nothing: their horizons are hidden. The model reads the metadata (a kernel builds each
  # tile's mask from it; XLA attention builds the dense [B, Q, S] mask once).
  horizon = jnp.where(row_ok[..., None], state.horizon[b, rows_lane], HIDDEN)
  mask = ThreadMask(horizon, state.slot_owner, state.slot_order, state.slot_valid)
  tokens, weights = cfg.rules.feed_inputs(state, rows_lane, cfg)
  mixed = {} if weights is None else {"token_weights": weights}  # an optional part of the model contract
  extras = cfg.rules.model_extras(state, cfg, num_q)  # e.g. Medusa: return_hidden, for its heads
  if cfg.certify_head:
    extras = {**extras, "skip_head": True}  # the step multiplies the head (choose_from_model)
  out = model_fn(params, tokens, state.position[b, rows_lane], mask, state.pool,
                 jnp.where(row_ok, slots[b, rows_lane], cfg.pool_slots), state.slot_pos,
                 defer_writes=defer, **mixed, **extras)
  model_out = dataclasses.replace(out, kv=None)  # choosing never reads the K/V (nor should a cond carry them)
  state, chosen, refused, logits = choose_from_model(params, choice_input(out, cfg.certify_head), rows_lane, row_ok,
                                                     state, cfg, forced, model_out)
  scatter_lane = jnp.where(row_ok, rows_lane, cfg.lanes)  # padding rows are dropped
  sampled = jnp.full((batch, cfg.lanes), -1, jnp.int32).at[b, scatter_lane].set(chosen, mode="drop")
  refused = jnp.zeros((batch, cfg.lanes), bool).at[b, scatter_lane].set(refused, mode="drop")
  lane_logits = None
  if cfg.record_logits:
    lane_logits = jnp.zeros((batch, cfg.lanes, logits.shape[-1])).at[b, scatter_lane].set(logits, mode="drop")
  kv_out = lane_rows(out.kv, scatter_lane, cfg) if defer else out.kv
  return sampled, refused, lane_logits, kv_out, (state.rule_state, state.head_fallbacks)


def lane_rows(fresh: FreshKV, scatter_lane, cfg: InterpreterConfig) -> FreshKV:
  """The model's new K/V rows [L, B, Q, ...] laid out by lane [L, B, T, ...] (every lane-count branch returns
  the same shapes); a lane without a row goes to no slot."""
  layers, batch = fresh.k.shape[:2]
  at = (slice(None), jnp.arange(batch)[:, None], scatter_lane)
  rows = lambda x: jnp.zeros((layers, batch, cfg.lanes) + x.shape[3:], x.dtype).at[at].set(x, mode="drop")
  slots = jnp.full((layers, batch, cfg.lanes), cfg.pool_slots, jnp.int32).at[at].set(fresh.slots, mode="drop")
  return FreshKV(rows(fresh.k), rows(fresh.v), slots)


def model_on_feeders(model_fn, params, state, feed, slots, cfg: InterpreterConfig, forced: bool):
  """Lane-count buckets: one compiled branch per Q in 1, 2, 4, ..., T; the step picks the smallest.
  Returns (sampled, refused, lane_logits, the pool with the step's K/V rows written, (rule_state,
  head_fallbacks))."""
  sizes = lane_buckets(cfg.lanes) if cfg.lane_buckets else (cfg.lanes,)
  # Under a switch the branches only read the pool and the rows are written after it: a branch that wrote the
  # pool would get XLA's copy of it, in and out (150 MB a step for ProPD at batch 8 on a CPU, model/kv_rows.py).
  # Without a switch it is the other way round: a write after reads in the same computation costs two copies.
  # On an H100 writing in the branch measured faster than deferring (kv_rows.defer_by_default).
  defer = len(sizes) > 1 and (defer_by_default() if cfg.defer_kv_writes is None else cfg.defer_kv_writes)
  branches = [functools.partial(run_rows, model_fn, params, num_q=q, forced=forced, cfg=cfg, defer=defer)
              for q in sizes]
  if len(branches) == 1:
    return branches[0](state, feed, slots)
  sampled, refused, lane_logits, kv_out, carried = jax.lax.switch(bucket_index(feed, sizes), branches, state,
                                                                  feed, slots)
  pool = KVPool(*write_fresh(state.pool.k, state.pool.v, kv_out)) if defer else kv_out
  return sampled, refused, lane_logits, pool, carried


def advance_scripts(state: InterpState, feed: jax.Array, cfg: InterpreterConfig) -> InterpState:
  """Forced replay: each thread that samples this step (it feeds, and is not closing) moves one token
  along its script."""
  b = jnp.arange(state.token.shape[0])[:, None]
  took = feed & (state.status != CLOSING)
  ptr = state.script_ptr.at[b, jnp.where(took, state.thread, cfg.max_threads)].add(1, mode="drop")
  return dataclasses.replace(state, script_ptr=ptr)


def append_records(state: InterpState, inserted, recorded, lane_logits, cfg) -> InterpState:
  """Appends this step's records: the inserted tokens (a spawn's `<async>` or APAR_CHILD, in lane
  order), then the lanes' new pending tokens in lane order. inserted: ([B, K, 5] rows, [B, K] keep)."""
  batch = recorded.shape[0]
  b = jnp.arange(batch)
  lanes = jnp.broadcast_to(jnp.arange(cfg.lanes), (batch, cfg.lanes))
  lane_rows = jnp.stack([jnp.full((batch, cfg.lanes), state.step), lanes, state.thread, state.token,
                         state.position], axis=2)
  inserted_rows, inserted_keep = inserted
  rows = jnp.concatenate([inserted_rows, lane_rows], axis=1)  # [B, K + T, 5]
  keep = jnp.concatenate([inserted_keep, recorded], axis=1)
  # dropped past the buffer's end: a chunk over a prefix of the pool (`batching.run_chunk`) has a smaller
  # cfg.max_records than the buffer it writes
  index = jnp.where(keep, state.num_records[:, None] + jnp.cumsum(keep, axis=1) - 1, state.records.shape[1])
  records = state.records.at[b[:, None], index].set(rows, mode="drop")
  rec_logits = state.record_logits
  if cfg.record_logits:
    rec_logits = rec_logits.at[b[:, None], index[:, inserted_keep.shape[1]:]].set(lane_logits, mode="drop")
  return dataclasses.replace(state, records=records, num_records=state.num_records + keep.sum(axis=1),
                             record_logits=rec_logits)


def is_content(tokens: jax.Array, in_topic: jax.Array, vocab) -> jax.Array:
  """[B, T] bool: the tokens are answer text (no tag, promise topic, end id or padding)."""
  return (tokens >= 0) & ~jnp.isin(tokens, language_ids(vocab)) & ~in_topic


def spend_budget(state: InterpState, recorded: jax.Array, cfg: InterpreterConfig,
                 in_promise: jax.Array | None = None) -> InterpState:
  """Counts the content tokens the lanes recorded this step; a request that reaches the content budget
  (`cfg.max_content`, when set) is cut there. recorded: [B, T] bool, the lanes' new pending tokens.
  in_promise: [B] main inside a promise's topic before the step (default: after it). The two differ only where
  main records PROMISE or LENGTH, tags either way, unless main records several tokens in a step (a tree path that
  ends at a PROMISE): its text before the tag is content, as the flag before the step says."""
  in_promise = state.in_promise if in_promise is None else in_promise
  topic = (state.thread == 0) & in_promise[:, None]  # main's lanes between PROMISE and LENGTH
  content = state.content + (recorded & is_content(state.token, topic, cfg.vocab)).sum(axis=1).astype(jnp.int32)
  return cut_at_budget(dataclasses.replace(state, content=content), cfg)


def cut_at_budget(state: InterpState, cfg: InterpreterConfig) -> InterpState:
  """Live requests whose content count has reached their budget (`state.content_budget`, `cfg.max_content`
  unless a server set its own; only when cfg.max_content is set) stop, as truncated."""
  if not cfg.max_content:
    return state
  spent = state.live & (state.content_budget > 0) & (state.content >= state.content_budget)
  return dataclasses.replace(state, truncated=state.truncated | spent, budget_spent=state.budget_spent | spent)


def cut_at_step_limit(state: InterpState) -> InterpState:
  """Live requests at their step limit stop, as truncated (in `generate` the loop ends there anyway)."""
  return dataclasses.replace(state, truncated=state.truncated | (state.live & (state.step >= state.step_limit)))


def decode_step(model_fn: ModelFn, params, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array,
                forced: bool) -> InterpState:
  """One step of every method: the rules' transitions around one model call."""
  rules = cfg.rules
  state = dataclasses.replace(state, step=state.step + 1)
  state, fed = rules.before_model(state, cfg, length_table)
  sampled, refused, lane_logits, pool, (rule_state, fallbacks) = model_on_feeders(
      model_fn, params, state, fed.feed, fed.slots, cfg, forced)
  state = dataclasses.replace(state, pool=pool, refusals=state.refusals + refused.sum(axis=1),
                              rule_state=rule_state, head_fallbacks=fallbacks)
  if forced:
    state = advance_scripts(state, fed.feed, cfg)
  in_promise = state.in_promise
  state, recorded = rules.after_model(state, fed, sampled, cfg, length_table)
  state = append_records(state, (fed.inserted, fed.inserted_keep), recorded, lane_logits, cfg)
  return cut_at_step_limit(spend_budget(state, recorded, cfg, in_promise))
