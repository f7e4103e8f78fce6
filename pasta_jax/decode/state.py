"""The interpreter's state: one pytree of fixed shapes for B requests x T lanes over S pool slots."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pasta_jax.decode.sampling import RowSampling
from pasta_jax.lang import schema
from pasta_jax.model.gemma import KVPool

# Lane status codes.
FREE, RUNNING, CLOSING, DONE = 0, 1, 2, 3
# Record columns: one row per token that becomes pending (docs/interpreter.md, What is recorded).
STEP, LANE, THREAD, TOKEN, POSITION = schema.STEP, schema.LANE, schema.THREAD, schema.TOKEN, schema.POSITION
PositionMode = schema.PositionMode


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InterpState:
  # Pool: K/V plus per-slot metadata for the visibility rule.
  pool: KVPool  # [layers, B, S, K, hd]
  slot_owner: jax.Array  # [B, S] int32 thread id
  slot_order: jax.Array  # [B, S] int32 write order
  slot_pos: jax.Array  # [B, S] int32 position
  slot_valid: jax.Array  # [B, S] bool
  slot_token: jax.Array  # [B, S] int32 the token written there (what a repetition penalty reads)
  next_slot: jax.Array  # [B] int32 next write order (= the append pointer while no slot is ever freed)
  peak_live: jax.Array  # [B] int32 most valid slots at once (APAR's memory metric)
  # Lanes: the thread table.
  status: jax.Array  # [B, T] int32 FREE / RUNNING / CLOSING / DONE
  thread: jax.Array  # [B, T] int32 thread id on the lane
  token: jax.Array  # [B, T] int32 pending token (next input)
  position: jax.Array  # [B, T] int32 its position
  horizon: jax.Array  # [B, T, U] int32 (pasta_jax.visibility)
  in_promise: jax.Array  # [B] bool main is between PROMISE and LENGTH
  next_thread: jax.Array  # [B] int32
  depth: jax.Array  # [B, T] int32 nesting depth of the lane's thread (main = 0)
  parent: jax.Array  # [B, U] int32 the thread that spawned each thread (-1: main / none)
  # Forced replay: per-thread scripts and read pointers.
  script: jax.Array  # [B, U, L] int32 (L = 1 and unused when not forcing)
  script_len: jax.Array  # [B, U] int32
  script_ptr: jax.Array  # [B, U] int32
  # Request outcome.
  finished: jax.Array  # [B] bool
  truncated: jax.Array  # [B] bool
  pool_full: jax.Array  # [B] bool: stopped because a step found no room in the pool (or, APAR, a deadlock)
  budget_spent: jax.Array  # [B] bool: stopped at the content-token budget (cfg.max_content)
  content: jax.Array  # [B] int32 content tokens recorded (no tags, topics or end ids)
  stalls: jax.Array  # [B] int32
  refusals: jax.Array  # [B] int32 rows whose most likely token a limit refused (a fork past a limit; a capped topic)
  head_fallbacks: jax.Array  # [B] int32 steps a certified head chose again from float32 (a row went uncertified)
  last_fed_step: jax.Array  # [B] int32
  # Per-request budgets (cfg's for every row in `generate`; a server sets each request's own).
  content_budget: jax.Array  # [B] int32 content tokens at which the request is cut (0: none; needs cfg.max_content)
  step_limit: jax.Array  # [B] int32 the step after which the request is cut (absolute, like `step`)
  slot_limit: jax.Array  # [B] int32 pool slots the request may write (slots >= it are never used)
  step: jax.Array  # [] int32
  # Records.
  records: jax.Array  # [B, R, 5] int32
  num_records: jax.Array  # [B] int32
  record_logits: jax.Array  # [B, R, V] float32 (R = 1 when not recording)
  sampling: RowSampling  # each row's sampling values and key stream (leaves [B])
  # The method's own state (`rules.init_rule_state`: Superposed Decoding's drafts), None for most methods.
  rule_state: Any = None

  @property
  def live(self) -> jax.Array:
    return ~(self.finished | self.truncated)
