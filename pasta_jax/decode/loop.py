"""The decode loop: one prefill, then `decode_step` in a `lax.while_loop` on device, whole or in chunks.

`prefill_and_run` is the whole run in one device call (what `api` compiles ahead of time and times);
`start` + `run_steps` are the same loop cut into chunks of steps, so a caller can stream (the state
stays on device between chunks). Shapes are bucketed to powers of two, so few programs compile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.sampling import RowSampling
from pasta_jax.decode.state import FREE, RUNNING, InterpState
from pasta_jax.decode.step import ModelFn, choice_input, choose_from_model, cut_at_budget, decode_step, is_content
from pasta_jax.errors import PastaError
from pasta_jax.lang import schema
from pasta_jax.model.gemma import KVPool
from pasta_jax.model.partitioning import gather_to_host
from pasta_jax.visibility import HIDDEN, UNBOUNDED, ThreadMask


def bucket(n: int, minimum: int = 16) -> int:
  """Smallest power of two >= n (and >= minimum): the shape buckets that bound recompiles."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


POOL_MARGIN = 1.25  # pool room per content token of the budget: tags, topics and `<async>`/`</async>` take slots too


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowLimits:
  """Each request's own budgets in a batch (every leaf [B] int32): what a run of it alone would be given
  (`free_budget`), so that its answer does not depend on the prompts it is batched with."""

  content: jax.Array  # content tokens (0: none)
  steps: jax.Array  # steps (from the run's start)
  slots: jax.Array  # pool slots it may write


def free_budget(prompt_len: int, new_tokens: int, lanes: int, rules, pool_tokens: int = 0,
                max_slots: int | None = None) -> tuple[int, int, int]:
  """(pool slots, max steps, max content) of a run of one prompt alone: its pool holds the bucketed prompt and the
  content budget with a margin (at most `max_slots`: a serving batch's pool; widened to hold `pool_tokens` new
  tokens, with the budgets of `new_tokens`), and the pool's room bounds the steps (`Rules.budgets`)."""
  padded = bucket(prompt_len)
  slots = pool_size(padded, new_tokens, lanes)
  if max_slots is not None:
    slots = min(slots, max_slots)
  steps, content = rules.budgets(new_tokens, slots - padded)
  if pool_tokens:
    slots = max(slots, pool_size(padded, pool_tokens, lanes))
  return slots, steps, content


def pool_size(prompt_len: int, new_tokens: int, lanes: int) -> int:
  """The pool of a free run: the (bucketed) prompt, the content budget plus a margin for tags, one slot per lane."""
  return bucket(prompt_len + math.ceil(new_tokens * POOL_MARGIN) + lanes)


def prefill(model_fn: ModelFn, params, prompt_tokens, lengths, pool_slots: int, pool_spec: tuple, sharding=None,
            skip_head: bool = False):
  """One model call over the padded prompts [B, P] into an empty pool of `pool_slots` slots, under the
  visibility rule (main's causal view). Returns the logits at each prompt's last token [B, 1, V] (skip_head:
  its hidden state [B, 1, D], for `step.choose_from_model`) and the pool. Padding rows write nowhere (slot S),
  so decode writes start right at each prompt's length."""
  batch, prompt_len = prompt_tokens.shape
  num_layers, kv_heads, head_dim, dtype = pool_spec
  pool = KVPool(*(jnp.zeros((num_layers, batch, pool_slots, kv_heads, head_dim), dtype),) * 2)
  if sharding is not None:  # under a mesh: requests over data x fsdp, KV heads over tensor (decode/sharding.py)
    pool = sharding.constrain_pool(pool)
  idx = jnp.arange(prompt_len)
  positions = jnp.broadcast_to(idx, (batch, prompt_len)).astype(jnp.int32)
  horizon = idx[:, None]  # [P, U=1]: the prompt is main's (thread 0); row p sees main's slots <= p
  slot_valid = jnp.arange(pool_slots)[None, :] < lengths[:, None]
  slot_idx = jnp.broadcast_to(jnp.arange(pool_slots), (batch, pool_slots)).astype(jnp.int32)
  mask = ThreadMask(jnp.broadcast_to(horizon, (batch,) + horizon.shape), jnp.zeros_like(slot_idx), slot_idx,
                    slot_valid)
  prefill_slots = jnp.where(idx[None, :] < lengths[:, None], positions, pool_slots)
  # Only the last prompt row's logits are computed: [B, P, V] of them would cost P output heads.
  head = {"skip_head": True} if skip_head else {}
  out = model_fn(params, prompt_tokens, positions, mask, pool, prefill_slots, slot_idx,
                 logit_rows=(lengths - 1)[:, None], **head)
  return choice_input(out, skip_head), out.kv


def init_state(pool: KVPool, prompt_tokens: jax.Array, lengths: jax.Array, first: jax.Array, script, script_len,
               cfg: InterpreterConfig, vocab_size: int, main_script_ptr: int, sampling: RowSampling) -> InterpState:
  """State after prefill: prompt b in slots 0..len_b-1, main pending its first token.

  With `cfg.rules.initial_threads` k > 1 (SoT's fan-out), threads 1..k-1 also start, on lanes 1..k-1: each
  sees the prompt and itself, sits at the prompt's end, and has its script's first token pending.
  """
  batch = lengths.shape[0]
  b_t = (batch, cfg.lanes)
  slot_idx = jnp.arange(cfg.pool_slots)
  lane_idx = jnp.arange(cfg.lanes)[None, :]
  k = cfg.rules.initial_threads
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
      slot_token=jnp.zeros((batch, cfg.pool_slots), jnp.int32).at[:, :prompt_tokens.shape[1]].set(prompt_tokens),
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
      budget_spent=jnp.zeros((batch,), bool),
      content=is_content(token[:, :k], jnp.zeros((batch, k), bool), cfg.vocab).sum(axis=1).astype(jnp.int32),
      stalls=jnp.zeros((batch,), jnp.int32), refusals=jnp.zeros((batch,), jnp.int32),
      head_fallbacks=jnp.zeros((batch,), jnp.int32),
      last_fed_step=jnp.zeros((batch,), jnp.int32),
      content_budget=jnp.full((batch,), cfg.max_content, jnp.int32),
      step_limit=jnp.full((batch,), cfg.max_steps, jnp.int32),
      slot_limit=jnp.full((batch,), cfg.pool_slots, jnp.int32),
      step=jnp.int32(0), records=records, num_records=jnp.full((batch,), k, jnp.int32),
      record_logits=rec_logits, sampling=sampling,
  )


def check_runnable(cfg: InterpreterConfig, forced: bool) -> None:
  """Refuses settings the loop cannot honour. The oracle position mode reserves each block's true length,
  which only a forced script knows: in free (or sampled-after-script) decoding there is none, and main's
  next position would silently fall at p + 2 (a length of -1)."""
  if cfg.position_mode in schema.ORACLE_MODES and (not forced or cfg.rules.sample_after_script):
    raise PastaError(f"position_mode={cfg.position_mode!r} needs every block's true length, which only forced "
                     "replay knows: use 'pred', 'pred-1x' or 'fixed' in free decoding")


def initial_state(pool, last, prompt_tokens, lengths, script, script_len, sampling: RowSampling, cfg: InterpreterConfig,
                  forced: bool, vocab_size: int, rule_inputs=None, params=None) -> InterpState:
  """The state after prefill: main's first token chosen from the last prompt logits [B, 1, V] (step 0; with
  `cfg.certify_head`, from the hidden states [B, 1, D] and `params`' head), and the rules' own state
  (`rules.init_rule_state`, then its first choice)."""
  init = functools.partial(init_state, pool, prompt_tokens, lengths, script=script, script_len=script_len,
                           cfg=cfg, vocab_size=vocab_size, sampling=sampling)
  state = init(first=jnp.zeros_like(lengths), main_script_ptr=0)
  state = dataclasses.replace(state, rule_state=cfg.rules.init_rule_state(prompt_tokens, lengths, rule_inputs, cfg))
  main_row = jnp.zeros((lengths.shape[0], 1), jnp.int32)
  state, first, _, last = choose_from_model(params, last, main_row, main_row == 0, state, cfg, forced)
  rule_state = state.rule_state
  state = init(first=first[:, 0], main_script_ptr=1)  # main's script starts after the prefill token
  state = cut_at_budget(dataclasses.replace(state, rule_state=rule_state), cfg)
  if cfg.record_logits:
    state = dataclasses.replace(state, record_logits=state.record_logits.at[:, 0].set(last[:, 0]))
  return state


def run_loop(model_fn: ModelFn, params, state: InterpState, limit, cfg: InterpreterConfig, forced: bool,
             vocab_size: int) -> InterpState:
  """`decode_step` until step `limit`, or until no request is live. Where the rules have a cheaper step
  (`rules.cheaper_steps`: ProPD's plain step while no tree is planned), each of their steps is followed by a loop
  of the cheaper step while it holds: a loop, not a conditional, so that it writes the KV pool in place."""
  length_table = jnp.asarray(cfg.vocab.length_table(vocab_size))

  def cond(s: InterpState):
    return (s.step < limit) & jnp.any(s.live)

  def step(s: InterpState, cfg: InterpreterConfig = cfg) -> InterpState:
    return decode_step(model_fn, params, s, cfg, length_table, forced)

  cheaper = None if forced else cfg.rules.cheaper_steps(cfg)
  if cheaper is None:
    return jax.lax.while_loop(cond, step, state)

  def then_cheaper(s: InterpState) -> InterpState:
    inner = jax.lax.while_loop(lambda v: cond(v) & cheaper.holds(v), functools.partial(step, cfg=cheaper.cfg),
                               cheaper.enter(s))
    return cheaper.leave(s, inner)

  return jax.lax.while_loop(cond, lambda s: then_cheaper(step(s)), state)


def finish(state: InterpState) -> InterpState:
  """A request that did not finish by the end of the loop is truncated (by the step budget)."""
  return dataclasses.replace(state, truncated=state.truncated | ~state.finished)


STATIC = ("model_fn", "cfg", "forced", "vocab_size", "pool_spec")


def start_state(model_fn, params, prompt_tokens, lengths, script, script_len, sampling: RowSampling, rule_inputs=None,
                limits: RowLimits | None = None, *,
                cfg: InterpreterConfig, forced: bool, vocab_size: int, pool_spec: tuple,
                prompt_pool: bool = False) -> InterpState:
  """Prefill and main's first token: the state before step 1. sampling: each row's values (`RowSampling`, within
  cfg.sampling's envelope). rule_inputs: read-only arrays the rules use on device (Superposed Decoding's n-gram
  index), or None. limits: each row's own budgets, within cfg's (None: cfg's for every row). prompt_pool: the
  state's pool holds only the prompts' P slots (the prefix of the pool they fill), not cfg.pool_slots: for a caller
  that writes them into a pool of its own (`batching.admit`), without prefilling over, or copying, empty slots."""
  check_runnable(cfg, forced)
  slots = prompt_tokens.shape[1] if prompt_pool else cfg.pool_slots
  last, pool = prefill(model_fn, params, prompt_tokens, lengths, slots, pool_spec, cfg.sharding, cfg.certify_head)
  state = initial_state(pool, last, prompt_tokens, lengths, script, script_len, sampling, cfg, forced, vocab_size,
                        rule_inputs, params)
  if limits is None:
    return state
  return cut_at_budget(dataclasses.replace(state, content_budget=limits.content, step_limit=limits.steps,
                                           slot_limit=limits.slots), cfg)


start = jax.jit(start_state, static_argnames=STATIC)


@functools.partial(jax.jit, static_argnames=STATIC)
def prefill_and_run(model_fn, params, prompt_tokens, lengths, script, script_len, sampling, rule_inputs=None,
                    limits: RowLimits | None = None, *,
                    cfg: InterpreterConfig, forced: bool, vocab_size: int, pool_spec: tuple) -> InterpState:
  """Prefill, then the whole decode loop on device: one call."""
  state = start_state(model_fn, params, prompt_tokens, lengths, script, script_len, sampling, rule_inputs, limits,
                      cfg=cfg, forced=forced, vocab_size=vocab_size, pool_spec=pool_spec)
  return finish(run_loop(model_fn, params, state, cfg.max_steps, cfg, forced, vocab_size))


@functools.partial(jax.jit, static_argnames=("model_fn", "cfg", "forced", "vocab_size", "steps"),
                   donate_argnames=("state",))
def run_steps(model_fn, params, state: InterpState, *, cfg: InterpreterConfig, forced: bool, vocab_size: int,
              steps: int) -> InterpState:
  """Up to `steps` more steps in one device call (a chunk of a streamed run)."""
  return run_loop(model_fn, params, state, jnp.minimum(state.step + steps, cfg.max_steps), cfg, forced, vocab_size)


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
  budget_spent: bool = False  # truncated at the content-token budget (cfg.max_content)
  content: int = 0  # content tokens recorded (no tags, topics or end ids), counted on device
  refusals: int = 0  # choices a limit refused: forks (APAR, scoped), topics cut at their cap (PASTA)
  head_fallbacks: int = 0  # steps whose certified head chose again from the float32 head (decode/certified_head.py)
  peak_live_slots: int = 0  # most pool slots valid at once (the prompt included)
  parents: np.ndarray | None = None  # [U] the thread that spawned each thread (-1: main / never spawned)
  slot_table: np.ndarray | None = None  # [S, 4] final (owner, write order, position, valid) per pool slot
  rule_outputs: dict | None = None  # what the rules keep of their own state (`rules.host_outputs`: drafts)


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
  """The jit-static part of a config: its sampling's envelope (the rows' values travel traced, `RowSampling`), so
  new sampling values reuse the loop."""
  return dataclasses.replace(cfg, sampling=cfg.sampling.envelope())


def run_interpreter(model_fn: ModelFn, params, prompts: Sequence[Sequence[int]], cfg: InterpreterConfig, *,
                    vocab_size: int, pool_spec: tuple, scripts=None, rule_inputs=None) -> list[RunOutput]:
  """Runs B prompts through the jitted interpreter; `scripts` (per request, per thread) forces tokens."""
  tokens, lengths = pad_prompts(prompts, cfg.pool_slots)
  script, script_len = pad_scripts(scripts, len(prompts), cfg.max_threads)
  final = prefill_and_run(model_fn, params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(script),
                          jnp.asarray(script_len), row_sampling(cfg.sampling, len(prompts)), rule_inputs,
                          cfg=static_config(cfg), forced=scripts is not None, vocab_size=vocab_size,
                          pool_spec=pool_spec)
  return unpack(final, cfg)


def row_sampling(sampling, batch: int) -> RowSampling:
  """Device arrays of `batch` rows that all sample by one config."""
  return jax.tree.map(jnp.asarray, RowSampling.of([sampling] * batch))


def host_state(final: InterpState) -> InterpState:
  """The final state on this host (numpy), without its pool: no result reads the K/V, which is most of the state.
  On a mesh over several hosts every host gathers the rest whole (each holds only its devices' requests)."""
  return gather_to_host(dataclasses.replace(final, pool=None))


def unpack(final: InterpState, cfg: InterpreterConfig) -> list[RunOutput]:
  final = host_state(final)
  outputs = []
  for b in range(final.records.shape[0]):
    n = int(final.num_records[b])
    outputs.append(RunOutput(
        records=np.asarray(final.records[b, :n]),
        logits=np.asarray(final.record_logits[b, :n]) if cfg.record_logits else None,
        steps=int(final.last_fed_step[b]), stalls=int(final.stalls[b]), refusals=int(final.refusals[b]),
        head_fallbacks=int(final.head_fallbacks[b]),
        finished=bool(final.finished[b]), truncated=bool(final.truncated[b]), pool_full=bool(final.pool_full[b]),
        budget_spent=bool(final.budget_spent[b]), content=int(final.content[b]),
        peak_live_slots=int(final.peak_live[b]), parents=np.asarray(final.parent[b]),
        slot_table=np.stack([np.asarray(final.slot_owner[b]), np.asarray(final.slot_order[b]),
                             np.asarray(final.slot_pos[b]), np.asarray(final.slot_valid[b], np.int32)], axis=1),
        rule_outputs=cfg.rules.host_outputs(final.rule_state, b)))
  return outputs
