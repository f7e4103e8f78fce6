"""The interpreter's state: one pytree of fixed shapes for B requests x T lanes over S pool slots."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.lang import schema
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.gemma import KVPool

# Lane status codes.
FREE, RUNNING, CLOSING, DONE = 0, 1, 2, 3
# Record columns: one row per token that becomes pending (docs/interpreter.md, What is recorded).
STEP, LANE, THREAD, TOKEN, POSITION = schema.STEP, schema.LANE, schema.THREAD, schema.TOKEN, schema.POSITION
PositionMode = schema.PositionMode
Mode = Literal["pasta", "apar"]


@dataclasses.dataclass(frozen=True)
class InterpreterConfig:
  """Static shape and behaviour of one compiled interpreter."""

  vocab: TagVocab
  lanes: int = 8  # T: lane 0 is main
  max_threads: int = 64  # U: thread ids per request (main + forks)
  pool_slots: int = 1024  # S: prompt + everything written
  max_steps: int = 1024
  sampling: SamplingConfig = SamplingConfig()
  position_mode: PositionMode = "pred"
  record_logits: bool = False  # keep each record's logits (tests: training forward == replay)
  lane_buckets: bool = True  # compute only as many query rows as lanes feed (1, 2, 4, ...)
  mode: Mode = "pasta"  # "apar": APAR's fork/child tokens, no sync, finished children released
  max_depth: int = 3  # APAR: a thread at this depth (main = 0) may not fork
  initial_threads: int = 1  # APAR: threads 0..k-1 start together after the prompt (SoT's point fan-out)
  sample_after_script: bool = False  # forced scripts are prefixes: a thread samples once its script ends

  def __post_init__(self):
    if self.lanes < 1 or self.max_threads < 1 or self.pool_slots < 1:
      raise ValueError(f"lanes, max_threads and pool_slots must be positive: {self}")
    if self.mode not in ("pasta", "apar"):
      raise ValueError(f"unknown interpreter mode {self.mode!r}; use pasta or apar")
    if not 1 <= self.initial_threads <= min(self.lanes, self.max_threads):
      raise ValueError(f"initial_threads={self.initial_threads} must be in [1, min(lanes, max_threads)]")
    if self.initial_threads > 1 and self.mode != "apar":
      raise ValueError("initial_threads > 1 (a fan-out) needs mode='apar': PASTA threads start at promises")
    if self.max_depth < 0:
      raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")
    schema.check_position_mode(self.position_mode)

  @property
  def max_records(self) -> int:
    # PASTA: every record becomes a pool write except main's final end token and the lanes' last
    # pending tokens at a stop; one step records at most one token per lane. APAR reuses released
    # slots: each step records one sampled token per feeding lane, plus one inserted child per spawn.
    if self.mode == "apar":
      return self.max_steps * self.lanes + self.max_threads + 1
    return self.pool_slots + self.lanes + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InterpState:
  # Pool: K/V plus per-slot metadata for the visibility rule.
  pool: KVPool  # [layers, B, S, K, hd]
  slot_owner: jax.Array  # [B, S] int32 thread id
  slot_order: jax.Array  # [B, S] int32 write order
  slot_pos: jax.Array  # [B, S] int32 position
  slot_valid: jax.Array  # [B, S] bool
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
  stalls: jax.Array  # [B] int32
  fork_refusals: jax.Array  # [B] int32 APAR: most likely token was [Fork], refused by a limit
  last_fed_step: jax.Array  # [B] int32
  step: jax.Array  # [] int32
  # Records.
  records: jax.Array  # [B, R, 5] int32
  num_records: jax.Array  # [B] int32
  record_logits: jax.Array  # [B, R, V] float32 (R = 1 when not recording)
  key: jax.Array

  @property
  def live(self) -> jax.Array:
    return ~(self.finished | self.truncated)
