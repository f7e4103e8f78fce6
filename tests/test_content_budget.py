"""The content-token budget (`max_new_tokens` in free decoding): a run is cut in the step its answer
reaches the budget in text tokens (tags, topics and end ids not counted), and only then: it is the
prefix of the same run without a budget, and the pool sized from the budget never fills first."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.result import content_ids
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.state import STEP
from pasta_jax.decode.toy_model import toy_apply
from pasta_jax.lang import metrics
from pasta_jax.methods import Apar, Pasta, Sequential, generate
from tests.programs import PLAIN_TOKENS, VOCAB, VOCAB_SIZE
from tests.test_interpreter_vs_reference import POOL_SPEC, SAMPLING_PARAMS

UNBOUNDED_CFG = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=256, max_steps=128,
                                  sampling=SamplingConfig(temperature=1.0))


def host_content(records: np.ndarray) -> int:
  """Content tokens of a run, counted on the host from its records (independent of the device count)."""
  return len(content_ids(metrics.annotated_from_records(records, VOCAB), VOCAB))


# Two prompts in one length bucket and three budgets: few shapes, so few compiles.
PROMPTS = st.lists(st.lists(PLAIN_TOKENS, min_size=5, max_size=8), min_size=2, max_size=2)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=PROMPTS, seed=st.integers(0, 2**16), budget=st.sampled_from([1, 6, 25]))
def test_budget_cuts_at_the_first_step_that_reaches_it(prompt_batch, seed, budget):
  free = dataclasses.replace(UNBOUNDED_CFG, sampling=SamplingConfig(temperature=1.0, seed=seed))
  cut = dataclasses.replace(free, max_content=budget)
  run = lambda cfg: run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE,
                                    pool_spec=POOL_SPEC)
  for whole, got in zip(run(free), run(cut), strict=True):
    assert got.content == host_content(got.records)
    assert whole.content == host_content(whole.records)
    n = len(got.records)
    np.testing.assert_array_equal(got.records, whole.records[:n])  # the same run, stopped early
    if got.budget_spent:  # cut in the step whose records first reach the budget
      assert got.truncated and not got.finished and whole.content >= budget
      last = got.records[-1, STEP]
      before = host_content(got.records[got.records[:, STEP] < last]) if last > 0 else 0
      assert host_content(got.records) >= budget > before
    else:  # never reached (or reached in the step the answer ended): the whole run
      assert n == len(whole.records) and got.finished == whole.finished
      assert whole.content < budget or whole.finished


@pytest.mark.parametrize("method", [Pasta(lanes=2, max_threads=4), Apar(lanes=2, max_threads=4), Sequential()],
                         ids=lambda m: m.name)
def test_max_new_tokens_is_the_content_budget(method):
  from tests.tiny import tiny_model
  [r] = generate(tiny_model(), ["hello"], method, max_new_tokens=9)
  assert (r.stop_reason, r.content_tokens, r.budget_spent) == ("tokens", 9, True)
  assert "content-token budget" in r.stop_note


def test_budget_must_not_be_negative():
  with pytest.raises(ValueError, match="max_content"):
    dataclasses.replace(UNBOUNDED_CFG, max_content=-1)
