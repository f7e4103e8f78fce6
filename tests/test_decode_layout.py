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
from pasta_jax.decode.runtime import Runtime
from pasta_jax.errors import PastaError
from pasta_jax.methods import Sequential, generate
from pasta_jax.model.gemma import (
  DECODE_SUFFIX,
  HEAD_COPY,
  PROJECTIONS,
  Gemma,
  KVPool,
  causal_mask,
  narrow_head,
  output_head,
  to_decode_layout,
)
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
  want = Gemma(cfg).apply(model.params, tokens, positions, mask, pool, write, kv_positions)
  got = api.model_fn(cfg, jnp.float32)(to_decode_layout(model.params), tokens, positions, mask, pool, write,
                                       kv_positions)
  np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got.kv.k, want.kv.k, atol=1e-5)
  np.testing.assert_allclose(got.kv.v, want.kv.v, atol=1e-5)


def test_decode_layout_full_forward_equals_training_layout():
  model = MODELS["tiny-gemma2"]
  tokens = jnp.arange(40, 80)[None]
  positions = jnp.arange(40)[None]
  want = Gemma(model.config).apply(model.params, tokens, positions, causal_mask(1, 40)).logits
  got = Gemma(model.config, decode_layout=True).apply(to_decode_layout(model.params), tokens, positions,
                                                      causal_mask(1, 40)).logits
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


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 2), (1, 3), (2, 1), (1, 5)])
def test_a_narrow_head_is_the_product_of_the_rounded_inputs(batch, rows):
  """A bfloat16 unembed: x is rounded to bfloat16 and the product accumulates in float32, whatever the row
  count (one row is padded to two and cut back)."""
  rng = np.random.default_rng(batch * 10 + rows)
  x = jnp.asarray(rng.normal(size=(batch, rows, 16)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(16, 50)), jnp.bfloat16)  # [D, V]: `narrow_head`'s layout
  rounded = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  want = np.einsum("bqd,dv->bqv", rounded, np.asarray(unembed.astype(jnp.float32), np.float64))
  got = output_head(x, unembed, True)
  assert got.shape == (batch, rows, 50) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_decode_params_with_a_narrow_head_keep_the_embedding_and_add_its_copy():
  model = MODELS["tiny-gemma3"]
  wide = api.decode_params(model.params, jnp.float32)["params"]
  narrow = api.decode_params(model.params, jnp.float32, head_dtype="bfloat16")["params"]
  assert HEAD_COPY not in wide and narrow[HEAD_COPY].dtype == jnp.bfloat16
  np.testing.assert_array_equal(narrow["embedder"], wide["embedder"])  # the input lookup stays float32
  np.testing.assert_array_equal(narrow[HEAD_COPY], wide["embedder"].T.astype(jnp.bfloat16))  # [D, V]


@pytest.mark.parametrize("head_dtype,dtype", [("float32", jnp.float32), ("int8", jnp.float32),
                                              ("float16", jnp.bfloat16), ("no-such-dtype", jnp.float32)])
def test_a_head_dtype_that_is_not_narrower_is_refused(head_dtype, dtype):
  with pytest.raises(PastaError, match="head_dtype"):
    api.check_head_dtype(head_dtype, dtype)


def test_generate_with_a_bfloat16_head_follows_the_rounded_logits():
  """Greedy decoding with the narrow head: each token of the sequential answer is the argmax of the float32-layout
  forward's hidden state times the rounded head (a replay of the answer), so the narrow head is what chose it."""
  model = MODELS["tiny-gemma3"]
  cfg = model.config
  [result] = generate(model, ["hello there"], Sequential(), max_new_tokens=12, runtime=Runtime(head_dtype="bfloat16"))
  [plain] = generate(model, ["hello there"], Sequential(), max_new_tokens=12)
  prompt = api.prompt_ids(model.tokenizer, ["hello there"], True)[0]
  answer = [int(t) for t in result.records[:, 3]]
  ids = jnp.asarray([prompt + answer], jnp.int32)
  length = ids.shape[1]
  hidden = Gemma(cfg).apply(model.params, ids, jnp.arange(length)[None], causal_mask(1, length),
                            skip_head=True).head_input
  head = narrow_head(model.params["params"]["embedder"], jnp.bfloat16)
  rows = hidden[:, len(prompt) - 1: length - 1]
  chosen = np.asarray(jnp.argmax(output_head(rows, head, True), -1))[0]
  np.testing.assert_array_equal(chosen, answer[: len(chosen)])
  assert len(answer) == len(plain.records)  # it decodes as much (tiny models rarely tie)


def test_the_step_with_a_narrow_head_multiplies_by_the_copy():
  """The step's logits are its hidden state times the bfloat16 copy, not the float32 embedding."""
  model = MODELS["tiny-gemma3"]
  cfg = model.config
  tokens, positions = jnp.asarray([[5, 9, 11]]), jnp.arange(3)[None]
  narrow = api.decode_params(model.params, jnp.float32, head_dtype="bfloat16")
  out = Gemma(cfg, decode_layout=True, head_dtype="bfloat16").apply(narrow, tokens, positions, causal_mask(1, 3),
                                                                    return_hidden=True)
  logits, hidden = out.logits, out.head_input
  np.testing.assert_allclose(logits, output_head(hidden, narrow["params"][HEAD_COPY], True), atol=1e-5, rtol=1e-5)
  wide = api.model_fn(cfg, jnp.float32)(api.decode_params(model.params, jnp.float32), tokens, positions,
                                        causal_mask(1, 3)).logits
  np.testing.assert_allclose(logits, wide, atol=0.1)  # the same function, rounded
  assert not np.allclose(logits, wide, atol=1e-6)


def test_a_narrow_head_is_part_of_an_eval_runs_identity_only_when_set():
  from pasta_jax.eval.methods import DecodeSettings
  assert "head_dtype" not in DecodeSettings().identity()  # runs stored before the option still resume
  assert DecodeSettings(head_dtype="bfloat16").identity()["head_dtype"] == "bfloat16"
