"""The certified narrow head (decode/certified_head.py): exact where it says so, an upper bound elsewhere, and greedy
decoding through it writes the float32 model's tokens, fallback included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api, certified_head
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError
from pasta_jax.methods import Pasta, Sequential, Superposed, generate
from tests.tiny import tiny_model

PROMPTS = ["hello there", "list three colours"]


NARROW = ["bfloat16", "int8"]


def head_params(embedding: jax.Array, head_dtype: str = "bfloat16") -> dict:
  return {"params": {"embedder": embedding, **certified_head.narrow_params(embedding, head_dtype)}}


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.05, 1.0, 30.0]), rows=st.sampled_from([(1, 2), (2, 3)]),
       head_dtype=st.sampled_from(NARROW), outlier=st.sampled_from([1.0, 40.0]))
def test_mixed_logits_are_exact_at_their_ids_and_bound_every_other_token(seed, scale, rows, head_dtype, outlier):
  """outlier: one hidden dimension that large (Gemma's final-normed states have such), which sets the int8 scale."""
  keys = jax.random.split(jax.random.key(seed), 2)
  embedding = jax.random.normal(keys[0], (700, 48)) * scale
  x = (jax.random.normal(keys[1], (*rows, 48)) * 3.0).at[..., 5].multiply(outlier)
  mixed, ids = certified_head.head_logits(head_params(embedding, head_dtype), x, None)
  truth = np.einsum("bqd,vd->bqv", np.asarray(x, np.float64), np.asarray(embedding, np.float64))
  at_ids = np.take_along_axis(truth, np.asarray(ids), axis=-1)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(mixed), np.asarray(ids), axis=-1), at_ids,
                             rtol=1e-5, atol=1e-5 * scale)
  bounded = np.ones(truth.shape, bool)
  np.put_along_axis(bounded, np.asarray(ids), False, axis=-1)
  assert np.all(np.asarray(mixed, np.float64)[bounded] >= truth[bounded])  # an upper bound everywhere else


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 700), k=st.integers(1, 8), block=st.sampled_from([2, 5, 16]),
       distinct=st.sampled_from([3, 50, 10_000]))
def test_top_ids_finds_the_k_largest_values_in_two_levels(seed, vocab, k, block, distinct):
  k = min(k, vocab)
  x = jnp.asarray(np.random.default_rng(seed).integers(0, distinct, (2, 3, vocab)).astype(np.float32))  # ties
  ids = certified_head.top_ids(x, k, block)
  assert ids.shape == (2, 3, k) and bool(jnp.all((ids >= 0) & (ids < vocab)))
  assert all(len(set(row)) == k for row in np.asarray(ids).reshape(-1, k).tolist())  # k distinct tokens
  np.testing.assert_array_equal(np.sort(np.asarray(jnp.take_along_axis(x, ids, -1)), -1),
                                np.sort(np.asarray(jax.lax.top_k(x, k)[0]), -1))


@pytest.mark.parametrize("head_dtype", NARROW)
def test_one_row_takes_the_float32_head(head_dtype):
  embedding = jax.random.normal(jax.random.key(0), (300, 32))
  x = jax.random.normal(jax.random.key(1), (1, 1, 32))
  logits, ids = certified_head.head_logits(head_params(embedding, head_dtype), x, None)
  assert ids is None
  np.testing.assert_allclose(logits, x @ embedding.T, rtol=1e-5, atol=1e-5)


def tokens_of(results) -> list[list[int]]:
  return [[int(t) for t in r.records[:, 3]] for r in results]


@pytest.mark.parametrize("name,method,head_dtype", [
    ("tiny-gemma3", "sequential", None), ("tiny-gemma3", "pasta", None), ("tiny-gemma3", "pasta", "bfloat16"),
    ("tiny-gemma2", "sequential", None), ("tiny-gemma2", "sequential", "bfloat16")])  # Gemma 2: a final softcap
def test_certified_greedy_decoding_writes_the_float32_tokens(name, method, head_dtype):
  """A batch of two (every step multiplies 2+ rows, so the narrow head and its certificate decide), under a
  repetition penalty the certificate must hold through."""
  model = tiny_model(name, seed=3)
  assert (model.config.final_logit_softcap is not None) == (name == "tiny-gemma2")
  sampling = SamplingConfig(repetition_penalty=1.3)
  plain = generate(model, PROMPTS, method, max_new_tokens=24, sampling=sampling)
  certified = generate(model, PROMPTS, method, max_new_tokens=24, sampling=sampling, runtime=Runtime(certify_head=True,
                                                                                                     head_dtype=head_dtype))
  assert tokens_of(certified) == tokens_of(plain)
  assert [r.text for r in certified] == [r.text for r in plain]
  assert all(0 <= r.head_fallbacks <= r.steps for r in certified) and not any(r.head_fallbacks for r in plain)


@pytest.mark.parametrize("head_dtype", NARROW)
def test_the_float32_head_decides_where_the_certificate_fails(monkeypatch, head_dtype):
  """One exact token per row and bounds made 1000x looser: the argmax nearly always lands on a bound, so nearly
  every step must be chosen again from the float32 head (without that fallback the tokens differ)."""
  monkeypatch.setattr(certified_head, "CANDIDATES", 1)
  # Neither a converted head (its bounds) nor a traced or compiled program (its K) of another test may be reused.
  monkeypatch.setattr(api, "_PARAMS_CACHE", {})
  monkeypatch.setattr(api, "COMPILED", api.CompileCache())
  jax.clear_caches()
  loose = certified_head.bound_rows
  monkeypatch.setattr(certified_head, "bound_rows", lambda embedding, wide: jax.tree.map(lambda b: 1e3 * b,
                                                                                          loose(embedding, wide)))
  model = tiny_model("tiny-gemma3", seed=3)
  sampling = SamplingConfig(repetition_penalty=1.3)
  plain = generate(model, PROMPTS, Sequential(), max_new_tokens=24, sampling=sampling)
  certified = generate(model, PROMPTS, Sequential(), max_new_tokens=24, sampling=sampling,
                       runtime=Runtime(certify_head=True, head_dtype=head_dtype))
  assert tokens_of(certified) == tokens_of(plain)
  assert all(r.head_fallbacks > r.steps // 2 for r in certified)  # counted: nearly every step fell back
  jax.clear_caches()  # the programs traced with K = 1


@pytest.mark.parametrize("options,match", [
    (dict(sampling=SamplingConfig(temperature=1.0)), "greedy"),
    (dict(return_logits=True), "greedy"),
    (dict(method=Superposed(ngram=None)), "superposed"),
])
def test_certify_head_refuses_what_reads_more_than_the_argmax(options, match):
  model = tiny_model("tiny-gemma3", seed=3)
  with pytest.raises(PastaError, match=match):
    generate(model, PROMPTS[:1], **{"method": Pasta(), **options}, max_new_tokens=4,
             runtime=Runtime(certify_head=True))


def test_a_forced_replay_with_a_certified_head_replays_the_same_records():
  """Forced tokens need no certificate (a check would fail on every scripted token and fall back each step)."""
  model = tiny_model("tiny-gemma3", seed=3)
  answer = '<promise topic="red" tokens="10"/><async> Red is warm.</async> <sync/> Done.'
  plain = generate(model, ["Two colors:", "Two more:"], Pasta(), forced_answers=[answer] * 2, chat=False)
  certified = generate(model, ["Two colors:", "Two more:"], Pasta(), forced_answers=[answer] * 2, chat=False,
                       runtime=Runtime(certify_head=True))
  for a, b in zip(plain, certified):
    np.testing.assert_array_equal(a.records, b.records)
    assert a.annotated == b.annotated


def test_an_int8_head_runs_only_certified():
  model = tiny_model("tiny-gemma3", seed=3)
  with pytest.raises(PastaError, match="int8.*certif"):
    generate(model, PROMPTS[:1], Pasta(), max_new_tokens=4, runtime=Runtime(head_dtype="int8"))
  assert api.check_head_dtype("int8", jnp.float32, certify_head=True) == "int8"
  assert api.narrow_head_dtype(None, certify_head=True) == "int8"  # a CPU's default certified head
  assert api.narrow_head_dtype("bfloat16", certify_head=True) == "bfloat16"
  assert api.narrow_head_dtype(None, certify_head=False) is None


def test_certify_head_is_part_of_an_eval_runs_identity_only_when_set():
  from pasta_jax.eval.methods import DecodeSettings
  assert "certify_head" not in DecodeSettings().identity()  # runs stored before the option still resume
  assert DecodeSettings(certify_head=True).identity()["certify_head"] is True
  assert DecodeSettings(certify_head=True).identity()["head_dtype"] == "int8"  # the copy a CPU compiles
