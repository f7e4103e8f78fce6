"""The step's lane-count buckets: which compiled branch a step takes for its feeding rows."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.rules.base import bucket_index, lane_buckets


@settings(max_examples=60, deadline=None)
@given(lanes=st.integers(1, 70), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_a_step_takes_the_smallest_bucket_that_holds_every_requests_rows(lanes, batch, seed):
  rng = np.random.default_rng(seed)
  sizes = lane_buckets(lanes)
  assert sizes[-1] == lanes and list(sizes) == sorted(set(sizes))
  rows = rng.integers(0, lanes + 1, batch)  # feeding rows per request, 0 to all lanes
  feed = np.arange(lanes)[None, :] < rows[:, None]
  feed = np.take_along_axis(feed, rng.permuted(np.tile(np.arange(lanes), (batch, 1)), axis=1), axis=1)
  want = min(i for i, size in enumerate(sizes) if size >= rows.max())
  got = bucket_index(jnp.asarray(feed), sizes)
  assert got.dtype == jnp.int32 and int(got) == want
