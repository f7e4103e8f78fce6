"""Invariant 1: the jitted interpreter equals the pure-Python reference interpreter.

Same records (step, lane, thread, token, position), steps, stalls, finished/truncated, over
hypothesis-generated tag programs driven by forced scripts, and over sampled runs of a toy model
whose logits depend on the attention mask. Each configuration compiles once: shapes are fixed
and only the program varies.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference import run_reference
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from tests.programs import VOCAB, VOCAB_SIZE, programs, prompts, same_run_up_to_a_near_tie

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
FORCED_PARAMS = toy_params(TOY, {})
# Biases that make a sampling toy model write real programs: promises, syncs, closes, ends.
TAG_BIAS = {VOCAB.promise: 2.5, VOCAB.sync: 2.5, VOCAB.async_close: 3.0, 1: 1.0,
            **{t: 2.0 for t in VOCAB.lengths[:4]}}
SAMPLING_PARAMS = toy_params(TOY, TAG_BIAS, seed=1)

CONFIGS = {
    "roomy": InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=256, max_steps=256),
    "few_lanes": InterpreterConfig(vocab=VOCAB, lanes=2, max_threads=16, pool_slots=256, max_steps=256),
    "tight_pool": InterpreterConfig(vocab=VOCAB, lanes=3, max_threads=4, pool_slots=48, max_steps=256),
    "fixed_pos": InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=256, max_steps=256,
                                   position_mode="fixed"),
    "oracle_pos": InterpreterConfig(vocab=VOCAB, lanes=3, max_threads=16, pool_slots=256, max_steps=256,
                                    position_mode="oracle"),
}


def reference(cfg: InterpreterConfig, params, prompt_batch, scripts=None):
  return run_reference(toy_apply, params, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                       pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling,
                       script=scripts, position_mode=cfg.position_mode)


def assert_same(jitted, oracle):
  assert len(jitted) == len(oracle)
  for got, want in zip(jitted, oracle):
    same_run_up_to_a_near_tie(got, want)


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_forced_programs_match_reference(name, data):
  cfg = CONFIGS[name]
  batch = 2  # batched requests that differ; one batch shape, so fewer compiles per configuration
  progs = [data.draw(programs(), label=f"program{i}") for i in range(batch)]
  prompt_batch = [data.draw(prompts, label=f"prompt{i}") for i in range(batch)]
  scripts = [p.script() for p in progs]
  got = run_interpreter(toy_apply, FORCED_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE,
                        pool_spec=POOL_SPEC, scripts=scripts)
  assert_same(got, reference(cfg, FORCED_PARAMS, prompt_batch, scripts))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       penalty=st.sampled_from([1.0, 3.0]))
def test_sampled_runs_match_reference(prompt_batch, seed, penalty):
  """Sampling with a fixed seed: the toy model writes its own tag programs under constraints; with a
  repetition penalty, over exactly the tokens each query sees (the reference's explicit visible sets)."""
  cfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=128, max_steps=96,
                          sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=seed,
                                                  repetition_penalty=penalty))
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE,
                        pool_spec=POOL_SPEC)
  assert_same(got, reference(cfg, SAMPLING_PARAMS, prompt_batch))


def test_sampled_runs_contain_real_programs():
  """Guards the test above against vacuity: the toy model does spawn, sync and finish forks."""
  cfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=128, max_steps=96,
                          sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=0))
  outs = run_interpreter(toy_apply, SAMPLING_PARAMS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 4, cfg,
                         vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  tokens = np.concatenate([o.records[:, 3] for o in outs])
  assert (tokens == VOCAB.async_open).sum() >= 3
  assert (tokens == VOCAB.sync).sum() >= 1
  assert (tokens == VOCAB.async_close).sum() >= 1


PENALTY_BASE = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=128, max_steps=64)
PENALIZED = dataclasses.replace(PENALTY_BASE, sampling=SamplingConfig(repetition_penalty=4.0))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2))
def test_greedy_repetition_penalty_matches_reference(prompt_batch):
  """Greedy under a strong repetition penalty: forks, syncs and main each penalize what they see, and only
  that (the reference's explicit visible sets)."""
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, PENALIZED, vocab_size=VOCAB_SIZE,
                        pool_spec=POOL_SPEC)
  assert_same(got, reference(PENALIZED, SAMPLING_PARAMS, prompt_batch))


def test_repetition_penalty_changes_greedy_answers():
  """Guards the test above against vacuity: on these prompts the penalty changes what greedy writes."""
  prompt_batch = [[5, 6, 7], [8, 9, 10, 11]]
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, PENALIZED, vocab_size=VOCAB_SIZE,
                        pool_spec=POOL_SPEC)
  plain = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, PENALTY_BASE, vocab_size=VOCAB_SIZE,
                          pool_spec=POOL_SPEC)
  assert any(a.records.tolist() != b.records.tolist() for a, b in zip(got, plain))
