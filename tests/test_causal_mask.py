"""The model's causal mask (whole-sequence forwards: judges, parity tests) is the visibility rule's
one-thread case, and equals the textbook lower-triangular mask cut at each row's length."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.model.gemma import causal_mask


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 9), data=st.data())
def test_causal_mask_is_lower_triangular_within_each_length(batch, length, data):
  lengths = np.asarray(data.draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch)))
  tril = np.tril(np.ones((length, length), bool))
  want = tril[None] & (np.arange(length)[None, None, :] < lengths[:, None, None])
  np.testing.assert_array_equal(np.asarray(causal_mask(batch, length, jnp.asarray(lengths))), want)
  np.testing.assert_array_equal(np.asarray(causal_mask(batch, length)), np.broadcast_to(tril, (batch, length, length)))
