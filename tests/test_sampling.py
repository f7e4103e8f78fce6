"""Sampling: greedy, top-k, top-p and temperature behave as their definitions say."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.sampling import (
  RowSampling,
  SamplingConfig,
  first_max_index,
  penalize_repeats,
  sample,
  sample_rows,
  truncate,
)

LOGITS = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.07, 0.03]))


def draws(cfg: SamplingConfig, n: int = 4000) -> np.ndarray:
  keys = jax.random.split(jax.random.key(cfg.seed), n)
  rows = jax.tree.map(jnp.asarray, RowSampling.of([cfg] * n))
  return np.asarray(sample_rows(jnp.broadcast_to(LOGITS, (n, 5)), keys, rows, cfg.envelope()))


def test_greedy_is_argmax():
  assert int(sample(LOGITS, jax.random.key(0), SamplingConfig())) == 0


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 2.5, 2.5, np.inf, np.nan]), min_size=1, max_size=40),
       rows=st.integers(1, 3))
def test_first_max_index_is_argmax_ties_infinities_and_nans_included(values, rows):
  x = np.stack([np.roll(np.asarray(values, np.float32), r) for r in range(rows)])  # [rows, V]: rows differ
  x = jnp.asarray(x) if rows > 1 else jnp.asarray(x[0])
  got = first_max_index(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_top_k_keeps_only_k_best():
  assert set(draws(SamplingConfig(temperature=1.0, top_k=2)).tolist()) == {0, 1}
  assert set(draws(SamplingConfig(temperature=1.0, top_k=1)).tolist()) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth never is.
  assert set(draws(SamplingConfig(temperature=1.0, top_p=0.8)).tolist()) == {0, 1, 2}
  assert set(draws(SamplingConfig(temperature=1.0, top_p=0.3)).tolist()) == {0}


def test_temperature_one_matches_softmax():
  freq = np.bincount(draws(SamplingConfig(temperature=1.0, seed=3), 20000), minlength=5) / 20000
  np.testing.assert_allclose(freq, np.exp(np.asarray(LOGITS)), atol=0.015)


def test_low_temperature_sharpens():
  freq = np.bincount(draws(SamplingConfig(temperature=0.25)), minlength=5) / 4000
  assert freq[0] > 0.9


def test_same_seed_same_draws_other_seed_differs():
  a, b = draws(SamplingConfig(temperature=1.0, seed=5)), draws(SamplingConfig(temperature=1.0, seed=5))
  c = draws(SamplingConfig(temperature=1.0, seed=6))
  assert (a == b).all() and (a != c).any()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)])
def test_bad_settings_are_refused(bad):
  with pytest.raises(ValueError, match="bad sampling settings"):
    SamplingConfig(**bad)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
  """CTRL's penalty as Hugging Face applies it (RepetitionPenaltyLogitsProcessor), on random logits of both
  signs and random seen sets."""
  torch = pytest.importorskip("torch")
  from transformers import RepetitionPenaltyLogitsProcessor

  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 50)).astype(np.float32)
  seen_ids = rng.integers(0, 50, size=(3, 12))
  seen = np.zeros((3, 50), bool)
  np.put_along_axis(seen, seen_ids, True, axis=1)
  want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(seen_ids), torch.tensor(logits)).numpy()
  got = np.asarray(penalize_repeats(jnp.asarray(logits), jnp.asarray(seen), penalty))
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_repetition_penalty_must_be_positive():
  with pytest.raises(ValueError, match="repetition_penalty"):
    SamplingConfig(repetition_penalty=0.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(0, 12), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.2, 2.0))
def test_truncation_equals_transformers_top_k_then_top_p(seed, top_k, top_p, temperature):
  """A row's kept tokens are those Hugging Face's TopKLogitsWarper then TopPLogitsWarper keep (on distinct logits:
  ties are the one place the two may differ)."""
  torch = pytest.importorskip("torch")
  from transformers import TopKLogitsWarper, TopPLogitsWarper

  logits = np.random.default_rng(seed).permutation(np.linspace(-4, 4, 40)).astype(np.float32)[None] / temperature
  want = torch.tensor(logits)
  if top_k:
    want = TopKLogitsWarper(top_k)(None, want)
  if top_p < 1.0:
    want = TopPLogitsWarper(top_p)(None, want)
  got = truncate(jnp.asarray(logits), jnp.asarray([top_k]), jnp.asarray([top_p], jnp.float32))
  np.testing.assert_array_equal(np.isfinite(want.numpy()) & (want.numpy() > -1e30),
                                np.asarray(got) > np.finfo(np.float32).min)


ROW_CONFIGS = st.builds(SamplingConfig, temperature=st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]),
                        top_k=st.sampled_from([0, 1, 3]), top_p=st.sampled_from([1.0, 0.9, 0.4]),
                        seed=st.integers(0, 2**32 - 1))


@settings(max_examples=25, deadline=None)
@given(configs=st.lists(ROW_CONFIGS, min_size=1, max_size=6), logit_seed=st.integers(0, 1000))
def test_each_row_samples_as_it_would_alone(configs, logit_seed):
  """A batch whose rows have different settings (one program, the envelope covering them all) draws for every row
  exactly what `sample` draws for that row with its own settings: greedy rows their argmax, the others by their own
  temperature, top-k and top-p."""
  logits = jnp.asarray(np.random.default_rng(logit_seed).normal(size=(len(configs), 30)).astype(np.float32) * 3)
  keys = jax.random.split(jax.random.key(logit_seed), len(configs))
  rows = jax.tree.map(jnp.asarray, RowSampling.of(configs))
  got = sample_rows(logits, keys, rows, SamplingConfig.covering(configs))
  want = [int(sample(logits[i], keys[i], cfg)) for i, cfg in enumerate(configs)]
  assert np.asarray(got).tolist() == want
  for i, cfg in enumerate(configs):
    if cfg.greedy:
      assert want[i] == int(jnp.argmax(logits[i]))


def test_an_envelope_covers_what_it_compiled_and_refuses_more():
  greedy, hot = SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.2)
  assert SamplingConfig.covering([greedy, hot]).covers(hot) and SamplingConfig.covering([greedy, hot]).covers(greedy)
  assert not greedy.envelope().covers(hot)
  assert hot.envelope() == SamplingConfig(temperature=0.3, top_k=5, repetition_penalty=1.5).envelope()
  with pytest.raises(ValueError, match="distinct_topics"):
    SamplingConfig.covering([greedy, SamplingConfig(distinct_topics=True)])
