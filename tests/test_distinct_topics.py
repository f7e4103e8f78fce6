"""`SamplingConfig.distinct_topics`: PASTA's main may not close a promise on a topic it already used.

The rule in three places that must agree: `lang.tokens.repeats_earlier_topic` (the definition, over main's
tokens), `decode.constraints.repeated_topic` (the same over the pool's metadata, as array ops), and the
interpreter against the reference interpreter on a toy model that writes short, often repeated topics.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.constraints import repeated_topic
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference import run_reference
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.errors import PastaError
from pasta_jax.eval.methods import DecodeSettings
from pasta_jax.lang.tokens import promise_topics, repeats_earlier_topic
from tests.programs import VOCAB, VOCAB_SIZE, prompts, same_run_up_to_a_near_tie

SLOTS = 24
# A small alphabet, so that topics repeat: two text ids (weighted up), PROMISE, two LENGTH ids, `<async>`, EOS.
ALPHABET = [2, 3, 2, 3, 2, 3, VOCAB.promise, VOCAB.lengths[0], VOCAB.lengths[1], VOCAB.async_open, 1]


P, L1, L2 = VOCAB.promise, VOCAB.lengths[0], VOCAB.lengths[1]
HAND_CASES = [  # (main's tokens, whether closing its open promise now would repeat a topic)
    ([P, 5, 6, L1, 9, P, 5, 6], True),  # the same topic; which LENGTH closed it is no matter
    ([P, 5, 6, L2, P, 5], False),  # a prefix of an earlier topic is not it
    ([P, 5, 6, L1, P, 5, 7], False),  # as long, other tokens
    ([P, 5, 6, L1, P, 6, 5], False),  # the same tokens in another order
    ([P, 5, 6, L1, P, 5, 6, 7], False),
    ([P, 5, 6, L1, P, 5, 6, L1], False),  # closed: nothing open to refuse
    ([P, L1, P], True),  # an empty topic twice
    ([P, 5, P, 5], False),  # an unclosed topic was never used
    ([7, 8, P, 9, L1, 3, L2, P, 9], True),  # a stray LENGTH outside a promise changes nothing
]


@pytest.mark.parametrize("main,repeats", HAND_CASES)
def test_hand_cases_in_both_forms(main, repeats):
  assert repeats_earlier_topic(main, VOCAB) == repeats
  n = len(main)
  pool = [jnp.asarray([x]) for x in (main, [0] * n, list(range(n)), [True] * n)]
  assert bool(repeated_topic(*pool, VOCAB)[0]) == repeats


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pool_form_equals_the_definition(data):
  """Main's and forks' slots in any write order, tags among them, some invalid: the array form reads main's
  tokens in write order, as the definition does, and nothing else."""
  batch, rows = 3, lambda values: st.lists(st.lists(values, min_size=SLOTS, max_size=SLOTS), min_size=3, max_size=3)
  tokens = np.asarray(data.draw(rows(st.sampled_from(ALPHABET))), np.int32)
  owner = np.asarray(data.draw(rows(st.sampled_from([0, 0, 0, 1, 2, 3]))), np.int32)
  valid = np.asarray(data.draw(rows(st.sampled_from([True, True, True, False]))))
  order = np.stack([np.asarray(data.draw(st.permutations(range(SLOTS)))) for _ in range(batch)]).astype(np.int32)
  got = repeated_topic(jnp.asarray(tokens), jnp.asarray(owner), jnp.asarray(order), jnp.asarray(valid), VOCAB)
  for b in range(batch):
    main = [int(tokens[b, s]) for s in np.argsort(order[b]) if valid[b, s] and owner[b, s] == 0]
    assert bool(got[b]) == repeats_earlier_topic(main, VOCAB), main


TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
# Promises with short topics: LENGTH right after PROMISE is likely, so the empty topic repeats unless refused.
TOPIC_BIAS = {VOCAB.promise: 3.0, VOCAB.sync: 1.5, VOCAB.async_close: 3.0, 1: 0.5,
              **{t: 3.5 for t in VOCAB.lengths[:2]}}
PARAMS = toy_params(TOY, TOPIC_BIAS, seed=3)
BASE = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=160, max_steps=96)


def with_rule(cfg: InterpreterConfig, **sampling) -> InterpreterConfig:
  return dataclasses.replace(cfg, sampling=SamplingConfig(distinct_topics=True, **sampling))


def reference(cfg: InterpreterConfig, prompt_batch):
  return run_reference(toy_apply, PARAMS, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                       pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling)


def closed_topics(records: np.ndarray) -> list[tuple[int, ...]]:
  """Main's closed promise topics, from its records (thread 0's tokens)."""
  return promise_topics([int(t) for t in records[records[:, 2] == 0][:, 3]], VOCAB)[0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.0, 1.0]))
def test_interpreter_matches_reference(prompt_batch, seed, temperature):
  cfg = with_rule(BASE, temperature=temperature, seed=seed)
  got = run_interpreter(toy_apply, PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  want = reference(cfg, prompt_batch)
  for g, w in zip(got, want, strict=True):
    same_run_up_to_a_near_tie(g, w)
    topics = closed_topics(g.records)
    assert len(topics) == len(set(topics)), topics


def test_the_rule_changes_what_the_toy_writes():
  """Guards the tests above against vacuity: without the rule this toy repeats topics; with it, never."""
  batch = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [20, 21], [30, 31, 32], [40], [44, 45], [50, 51, 52]]
  cfg = dataclasses.replace(BASE, sampling=SamplingConfig(temperature=1.0, seed=0))
  plain = run_interpreter(toy_apply, PARAMS, batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  ruled = run_interpreter(toy_apply, PARAMS, batch, with_rule(cfg, temperature=1.0, seed=0),
                          vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  repeats = sum(len(t) - len(set(t)) for t in map(closed_topics, (o.records for o in plain)))
  assert repeats >= 4
  assert all(len(t) == len(set(t)) for t in map(closed_topics, (o.records for o in ruled)))
  assert sum(len(closed_topics(o.records)) for o in ruled) >= 12  # it still writes promises


def test_methods_that_cannot_keep_the_rule_refuse_it():
  from pasta_jax.decode.naive import naive_prefill_and_run
  cfg = with_rule(BASE)
  with pytest.raises(PastaError, match="distinct_topics"):
    naive_prefill_and_run(toy_apply, PARAMS, jnp.zeros((1, 4), jnp.int32), jnp.asarray([4]), None, None, 0,
                          cfg=cfg, forced=False, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)


def test_eval_identity_leaves_the_rule_out_at_its_default():
  """Run folders written before the setting existed still resume; a run with the rule on is another run."""
  assert "distinct_topics" not in DecodeSettings().identity()
  assert DecodeSettings(distinct_topics=True).identity()["distinct_topics"] is True
