"""The int8 head (model/int8_head.py): what it stores stands for the head within half a step per entry, and its
logits are exactly those of the rounded hidden row times the rounded head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pasta_jax.model import int8_head


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 50.0]))
@example(seed=576, scale=1e-3)  # an entry on a half step: the product's float32 rounding shows
def test_the_int8_head_rounds_each_entry_by_at_most_half_its_tokens_step(seed, scale):
  embedding = (jax.random.normal(jax.random.key(seed), (300, 24)) * scale).at[7].set(0.0)  # an all-zero token
  q, token_scale = int8_head.quantize_head(embedding)
  assert q.dtype == jnp.int8 and q.shape == (24, 300) and token_scale.shape == (300,)
  error = np.abs(np.asarray(int8_head.dequantized(q, token_scale)) - np.asarray(embedding))
  # half a step, plus the float32 rounding of q * scale (one spacing of the entry)
  entry_ulp = np.spacing(np.abs(np.asarray(embedding, np.float32)))
  assert np.all(error <= 0.5 * np.asarray(token_scale)[:, None] * (1 + 1e-6) + entry_ulp)
  assert np.all(np.abs(np.asarray(q)) <= 127) and not np.any(np.asarray(q)[:, 7])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.sampled_from([(1, 1), (1, 2), (2, 3)]), outlier=st.sampled_from([1, 60]))
def test_int8_logits_are_the_rounded_row_times_the_rounded_head(seed, rows, outlier):
  keys = jax.random.split(jax.random.key(seed), 2)
  embedding = jax.random.normal(keys[0], (500, 32)) * 0.05
  x = (jax.random.normal(keys[1], (*rows, 32)) * 2.0).at[..., 3].multiply(outlier)
  q, token_scale = int8_head.quantize_head(embedding)
  logits, x_q = int8_head.int8_logits(x, q, token_scale)
  # Two levels: the row's rounding is half a step of the second level, ~1/64000 of its largest entry.
  step = np.abs(np.asarray(x)).max(-1, keepdims=True) / 127 / 127
  assert np.all(np.abs(np.asarray(x_q) - np.asarray(x)) <= 0.51 * step + 1e-7)
  truth = np.einsum("bqd,vd->bqv", np.asarray(x_q, np.float64), np.asarray(int8_head.dequantized(q, token_scale),
                                                                          np.float64))
  np.testing.assert_allclose(np.asarray(logits, np.float64), truth, rtol=1e-6, atol=1e-6 * np.abs(truth).max())
