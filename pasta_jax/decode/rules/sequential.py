"""Plain sequential decoding as rules: one lane, no tags, no constraint; an end id finishes at once."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pasta_jax.decode.pool import append_slots, write_slots
from pasta_jax.decode.rules.base import InterpreterConfig, Rules, StepFeed
from pasta_jax.decode.state import DONE, RUNNING, InterpState


@dataclasses.dataclass(frozen=True)
class SequentialRules(Rules):
  """Main alone feeds its pending token each step and samples the next from the full vocabulary."""

  name: ClassVar[str] = "sequential"
  ignore_eos: bool = False  # never sample an end id (benchmarks: a fixed number of tokens, as HF's min_new_tokens)

  def validate(self, cfg: InterpreterConfig) -> None:
    super().validate(cfg)
    if cfg.lanes != 1 or self.initial_threads != 1:
      raise ValueError(f"sequential decoding runs one lane and one thread, got lanes={cfg.lanes}")

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    running = state.live & (state.status[:, 0] == RUNNING)
    at_end = running & jnp.isin(state.token[:, 0], jnp.asarray(cfg.vocab.eos_ids))  # the prefill's token
    room = state.next_slot < state.slot_limit
    feed = (running & ~at_end & room)[:, None]
    slots = append_slots(feed, state, cfg.pool_slots)
    state = write_slots(state, feed, slots)
    batch = feed.shape[0]
    none = (jnp.zeros((batch, 0, 5), jnp.int32), jnp.zeros((batch, 0), bool))
    return state, StepFeed(feed, slots, *none, (at_end, running & ~at_end & ~room))

  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig):
    no_refusal = jnp.zeros(rows_lane.shape, bool)
    if not self.ignore_eos:
      return None, no_refusal
    return ~jnp.isin(jnp.arange(logits.shape[-1]), jnp.asarray(cfg.vocab.eos_ids)), no_refusal

  def after_model(self, state: InterpState, step: StepFeed, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array):
    at_end, out_of_room = step.plan
    fed = step.feed[:, 0]
    ended = at_end | (fed & jnp.isin(sampled[:, 0], jnp.asarray(cfg.vocab.eos_ids)))
    state = dataclasses.replace(
        state,
        token=jnp.where(step.feed, sampled, state.token),
        position=jnp.where(step.feed, state.position + 1, state.position),
        status=jnp.where(ended[:, None], DONE, state.status),
        finished=state.finished | ended,
        truncated=state.truncated | out_of_room,
        pool_full=state.pool_full | out_of_room,
        last_fed_step=jnp.where(fed, state.step, state.last_fed_step),
    )
    return state, step.feed
