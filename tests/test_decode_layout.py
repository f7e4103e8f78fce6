"""The decode layout (`to_decode_layout`, `Gemma(decode_layout=True)`) is the same function as the training
layout, for any number of rows, with and without a KV pool; a tree of the wrong layout fails loudly."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api
from pasta_jax.model.gemma import DECODE_SUFFIX, PROJECTIONS, Gemma, KVPool, causal_mask, output_head, to_decode_layout
from tests.tiny import tiny_model

MODELS = {name: tiny_model(name, seed=3) for name in ("tiny-gemma1", "tiny-gemma2", "tiny-gemma3")}


def test_conversion_transposes_every_projection_and_keeps_the_rest():
  params = MODELS["tiny-gemma3"].params
  converted = to_decode_layout(params)
  before = {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
  after = {"/".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_leaves_with_path(converted)}
  assert len(before) == len(after)
  moved = 0
  for path, x in before.items():
    name = path.rsplit("/", 1)[-1]
    if name in PROJECTIONS:
      y = after[path + DECODE_SUFFIX]
      n_in = PROJECTIONS[name]
      np.testing.assert_array_equal(np.moveaxis(np.asarray(y), tuple(range(y.ndim - n_in, y.ndim)),
                                                tuple(range(n_in))), np.asarray(x))
      moved += 1
    else:
      assert after[path] is x
  assert moved == 7 * MODELS["tiny-gemma3"].config.num_layers


@settings(max_examples=5, deadline=None)  # each new (model, batch, rows) shape compiles: keep them few
@given(name=st.sampled_from(sorted(MODELS)), batch=st.sampled_from([1, 3]), rows=st.sampled_from([1, 3, 24]),
       seed=st.integers(0, 1000))
def test_decode_layout_step_equals_training_layout(name, batch, rows, seed):
  """One pool step of `rows` query rows per request: same logits and same pool writes."""
  model = MODELS[name]
  cfg = model.config
  rng = np.random.default_rng(seed)
  slots = 32
  pool = KVPool(*(jnp.asarray(rng.normal(size=(cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)),
                              jnp.float32) for _ in range(2)))
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, rows)), jnp.int32)
  positions = jnp.asarray(rng.integers(0, 40, (batch, rows)), jnp.int32)
  mask = jnp.asarray(rng.random((batch, rows, slots)) < 0.6)
  write = jnp.asarray(rng.permutation(slots)[:rows][None].repeat(batch, 0), jnp.int32)
  kv_positions = jnp.asarray(rng.integers(0, 40, (batch, slots)), jnp.int32)
  want, want_pool = Gemma(cfg).apply(model.params, tokens, positions, mask, pool, write, kv_positions)
  got, got_pool = api.model_fn(cfg, jnp.float32)(to_decode_layout(model.params), tokens, positions, mask, pool,
                                                 write, kv_positions)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_pool.k, want_pool.k, atol=1e-5)
  np.testing.assert_allclose(got_pool.v, want_pool.v, atol=1e-5)


def test_decode_layout_full_forward_equals_training_layout():
  model = MODELS["tiny-gemma2"]
  tokens = jnp.arange(40, 80)[None]
  positions = jnp.arange(40)[None]
  want, _ = Gemma(model.config).apply(model.params, tokens, positions, causal_mask(1, 40))
  got, _ = Gemma(model.config, decode_layout=True).apply(to_decode_layout(model.params), tokens, positions,
                                                         causal_mask(1, 40))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_tree_of_the_other_layout_is_refused():
  model = MODELS["tiny-gemma1"]
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(flax.errors.ScopeParamNotFoundError, match="q_t"):
    api.model_fn(model.config, jnp.float32)(model.params, tokens, tokens, causal_mask(1, 4))
  with pytest.raises(flax.errors.ScopeParamNotFoundError, match="'q'|\"q\""):
    Gemma(model.config).apply(to_decode_layout(model.params), tokens, tokens, causal_mask(1, 4))


def test_decode_params_are_cached_per_model_and_dtype():
  model = MODELS["tiny-gemma1"]
  first = api.decode_params(model.params, jnp.float32)
  assert api.decode_params(model.params, jnp.float32) is first
  assert api.decode_params(model.params, jnp.bfloat16) is not first


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 2), (1, 3), (3, 1), (1, 4), (2, 5)])
def test_output_head_is_one_function_in_every_form(batch, rows):
  """`output_head` picks its matmul form by the row count (token-major for 2-3 rows): the logits do not."""
  rng = np.random.default_rng(batch * 10 + rows)
  x = jnp.asarray(rng.normal(size=(batch, rows, 16)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
  want = np.einsum("bqd,vd->bqv", np.asarray(x, np.float64), np.asarray(unembed, np.float64))
  for decode_layout in (False, True):
    got = output_head(x, unembed, decode_layout)
    assert got.shape == (batch, rows, 50) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
