"""The scoped mode (the earlier paper): the jitted interpreter equals the pure-Python reference.

Same records (step, lane, thread, token, position), steps, stalls, finished / truncated / pool_full, on
hypothesis script trees (nested scopes to depth 3, promises inside forks, scopes in sequence, EOS inside a
scope, more promises than lanes, a tight pool) and on sampled runs of a toy model whose logits depend on
the attention mask. Each configuration compiles once: only the program varies.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference.scoped import run_scoped_reference
from pasta_jax.decode.rules.scoped import ScopedRules
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from tests.programs import VOCAB, VOCAB_SIZE, prompts, same_run_up_to_a_near_tie
from tests.scoped_programs import scoped_programs

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
PARAMS = toy_params(TOY, {})
TAG_BIAS = {VOCAB.scope_open: 2.0, VOCAB.scope_close: 2.0, VOCAB.bare_promise: 3.0, VOCAB.async_close: 3.0, 1: 0.5}
SAMPLING_PARAMS = toy_params(TOY, TAG_BIAS, seed=1)


def scoped_config(lanes: int, max_threads: int, pool_slots: int, max_steps: int = 200, **kw) -> InterpreterConfig:
  return InterpreterConfig(vocab=VOCAB, lanes=lanes, max_threads=max_threads, pool_slots=pool_slots,
                           max_steps=max_steps, rules=ScopedRules(), **kw)


CONFIGS = {
    "roomy": scoped_config(lanes=8, max_threads=32, pool_slots=256),
    "few_lanes": scoped_config(lanes=2, max_threads=32, pool_slots=256),
    "three_lanes": scoped_config(lanes=3, max_threads=8, pool_slots=256),
    "tight_pool": scoped_config(lanes=4, max_threads=16, pool_slots=40),
}


def reference(cfg: InterpreterConfig, params, prompt_batch, scripts=None, model=toy_apply):
  return run_scoped_reference(model, params, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                              pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling,
                              scripts=scripts, max_depth=cfg.rules.max_depth)


def assert_same(jitted, oracle):
  assert len(jitted) == len(oracle)
  for got, want in zip(jitted, oracle):
    if not same_run_up_to_a_near_tie(got, want):
      continue
    assert got.pool_full == want.pool_full
    # The pool as written: every slot's owner and position.
    written = [(e.thread, e.position) for e in want.pool]
    table = got.slot_table[: len(written)]
    assert [(int(o), int(p)) for o, _, p, _ in table] == written


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_forced_scoped_programs_match_reference(name, data):
  """4 configurations x 25 examples x 2 requests: 200 programs per run (hypothesis keeps the failures it finds)."""
  cfg = CONFIGS[name]
  trees = [data.draw(scoped_programs(), label=f"program{i}") for i in range(2)]
  prompt_batch = [data.draw(prompts, label=f"prompt{i}") for i in range(2)]
  schedule = reference(cfg, None, prompt_batch, trees, model=None)  # thread ids in spawn order
  flat = [r.scripts_by_thread for r in schedule]
  got = run_interpreter(toy_apply, PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                        scripts=flat)
  assert_same(got, schedule)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       penalty=st.sampled_from([1.0, 3.0]))
def test_sampled_scoped_runs_match_reference(prompt_batch, seed, penalty):
  """The toy model writes its own scoped programs under the constraint masks, with a fixed seed (and a
  repetition penalty over what each query sees)."""
  cfg = scoped_config(lanes=4, max_threads=16, pool_slots=128, max_steps=80,
                      sampling=SamplingConfig(temperature=1.0, seed=seed, repetition_penalty=penalty))
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  assert_same(got, reference(cfg, SAMPLING_PARAMS, prompt_batch))


def test_sampled_scoped_runs_contain_real_programs():
  """Guards the test above against vacuity: the toy model opens scopes, forks (also inside forks) and syncs."""
  cfg = scoped_config(lanes=4, max_threads=16, pool_slots=128, max_steps=80,
                      sampling=SamplingConfig(temperature=1.0, seed=0))
  outs = run_interpreter(toy_apply, SAMPLING_PARAMS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 4, cfg,
                         vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  tokens = np.concatenate([o.records[:, 3] for o in outs])
  assert (tokens == VOCAB.async_open).sum() >= 3
  assert (tokens == VOCAB.scope_close).sum() >= 3
  nested = [u for o in outs for u, p in enumerate(o.parents) if p > 0]
  assert nested, "no fork spawned a fork of its own"
