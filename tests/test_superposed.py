"""Superposed Decoding on the one decode core, against a pure-Python oracle (tests/superposed_reference.py),
and its n-gram index against brute-force counting over random corpora."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import ngram
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.rules import SequentialRules, SuperposedRules
from pasta_jax.decode.rules.superposed import superposition_weights
from pasta_jax.decode.state import TOKEN
from pasta_jax.decode.toy_model import toy_apply, toy_params
from pasta_jax.methods import Pasta, Sequential, Superposed, generate
from tests.programs import VOCAB, VOCAB_SIZE
from tests.superposed_reference import brute_count, p_ngram, superposed_reference
from tests.test_interpreter_vs_reference import POOL_SPEC, TOY

EOS = 1
PARAMS = toy_params(TOY, {EOS: 2.0}, seed=3)  # end ids likely enough that drafts finish
PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [33, 34, 35, 36, 37, 38, 39]]


def run(rules, prompts, new_tokens, index=None):
  cfg = InterpreterConfig(vocab=VOCAB, lanes=1, max_threads=1, pool_slots=32, max_steps=new_tokens - 1, rules=rules)
  return run_interpreter(toy_apply, PARAMS, prompts, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                         rule_inputs=None if index is None else index.device_arrays())


def test_one_draft_without_ngrams_is_greedy_decoding():
  plain = run(SequentialRules(), PROMPTS, 12)
  drafts = run(SuperposedRules(drafts=1, ngram_weight=0.0), PROMPTS, 12)
  for p, d in zip(plain, drafts, strict=True):
    greedy = [t for t in p.records[:, TOKEN].tolist() if t != EOS]
    assert d.rule_outputs["draft_tokens"] == [greedy]
    assert d.finished == p.finished


def corpora():
  doc = st.lists(st.integers(0, 11), min_size=0, max_size=25)
  return st.lists(doc, min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(corpus=corpora(), keys=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), min_size=1, max_size=20))
def test_index_counts_equal_brute_force(corpus, keys):
  index = ngram.NgramIndex.build(corpus)
  padded = np.zeros((len(keys), 6), np.int32)
  for i, k in enumerate(keys):
    padded[i, : len(k)] = k
  got = index.count(padded, np.array([len(k) for k in keys]))
  assert got.tolist() == [brute_count(corpus, k) for k in keys]


@settings(max_examples=25, deadline=None)
@given(corpus=corpora(), context=st.lists(st.integers(-2, 11), min_size=5, max_size=5),
       tokens=st.lists(st.integers(0, 11), min_size=1, max_size=6))
def test_interpolated_ngram_probabilities_equal_brute_force(corpus, context, tokens):
  context = [ngram.UNKNOWN if t < 0 else t for t in context]
  index = ngram.NgramIndex.build(corpus)
  want = [p_ngram(corpus, context, t, ngram.PAPER_WEIGHTS) for t in tokens]
  got = ngram.interpolated(index.arrays, np.asarray(context, np.int32), np.asarray(tokens, np.int32), xp=np)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_device_lookups_equal_host_lookups():
  """The jitted look-up (one compile: fixed shapes) equals the numpy one on many contexts at once."""
  rng = np.random.default_rng(1)
  index = ngram.NgramIndex.build([rng.integers(0, 6, size=n) for n in (40, 3, 25, 0, 60)])
  context = rng.integers(-2, 6, size=(64, 5)).astype(np.int32)
  context[context < 0] = ngram.UNKNOWN
  tokens = rng.integers(0, 6, size=(64, 9)).astype(np.int32)
  on_host = ngram.interpolated(index.arrays, context, tokens, xp=np)
  on_device = jax.jit(ngram.interpolated)(index.device_arrays(), jnp.asarray(context), jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(on_device), on_host, rtol=1e-6)
  assert (on_host > 0).mean() > 0.3  # the contexts do occur: the comparison is not all zeros


def test_superposition_weights_are_normalised_draft_probabilities():
  score = jnp.asarray([[np.log(0.5), np.log(0.3), np.log(0.2)], [0.0, -jnp.inf, -jnp.inf]])
  np.testing.assert_allclose(superposition_weights(score), [[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]], rtol=1e-6)
  assert np.asarray(superposition_weights(jnp.full((1, 2), -jnp.inf))).tolist() == [[1.0, 0.0]]


CORPUS = [list(np.random.default_rng(s).integers(0, 24, size=60)) for s in range(6)]


@settings(max_examples=2, deadline=None)
@given(k=st.integers(1, 4), alpha=st.sampled_from([0.0, 0.54]), tau=st.sampled_from([0.06, 1.0]),
       prompt=st.sampled_from(PROMPTS), new_tokens=st.integers(1, 9))
def test_drafts_equal_the_reference(k, alpha, tau, prompt, new_tokens):
  """Alive/finished bookkeeping, superposed inputs and n-gram smoothing, step by step, vs the oracle."""
  index = ngram.NgramIndex.build(CORPUS)
  rules = SuperposedRules(drafts=k, temperature=tau, ngram_weight=alpha)
  [out] = run(rules, [prompt], new_tokens, index if alpha else None)
  want, settled = superposed_reference(toy_apply, PARAMS, prompt, k=k, candidates=3 * k, tau=tau, alpha=alpha,
                                       weights=ngram.PAPER_WEIGHTS, corpus=[list(map(int, d)) for d in CORPUS],
                                       eos={EOS}, max_new=new_tokens)
  assert out.rule_outputs["draft_tokens"] == [t for t, _, _ in want]
  assert out.rule_outputs["draft_finished"] == [f for _, _, f in want]
  np.testing.assert_allclose(out.rule_outputs["draft_scores"], [s for _, s, _ in want], rtol=1e-4, atol=1e-4)
  assert out.finished == settled


def test_ngram_smoothing_changes_the_drafts():
  index = ngram.NgramIndex.build(CORPUS)
  plain = run(SuperposedRules(drafts=3, ngram_weight=0.0, temperature=1.0), PROMPTS, 8)
  smoothed = run(SuperposedRules(drafts=3, ngram_weight=0.54, temperature=1.0), PROMPTS, 8, index)
  assert [r.rule_outputs["draft_tokens"] for r in plain] != [r.rule_outputs["draft_tokens"] for r in smoothed]


def test_bad_settings_name_the_problem():
  with pytest.raises(ValueError, match="drafts"):
    InterpreterConfig(vocab=VOCAB, lanes=1, max_threads=1, rules=SuperposedRules(drafts=0))
  with pytest.raises(ValueError, match="n-gram index"):
    run(SuperposedRules(drafts=2), PROMPTS, 4)
  with pytest.raises(ValueError, match="non-negative"):
    ngram.NgramIndex.build([[1, -3]])


def test_generate_returns_the_drafts_best_first():
  from pasta_jax.errors import PastaError
  from tests.tiny import tiny_model
  model = tiny_model()
  docs = [model.tokenizer.encode(t, add_bos=False) for t in ("the cat sat on the mat", "a dog ran to the cat")]
  index = ngram.NgramIndex.build(docs)
  [one] = generate(model, ["q"], Superposed(drafts=1, ngram=None), max_new_tokens=8)
  [greedy] = generate(model, ["q"], Sequential(), max_new_tokens=8)
  assert one.drafts == (greedy.text,) and one.text == greedy.text
  [three] = generate(model, ["q"], Superposed(drafts=3, ngram=index), max_new_tokens=8)
  assert len(three.drafts) == 3 and three.text == three.drafts[0] and three.method == "superposed"
  assert list(three.draft_scores) == sorted(three.draft_scores, reverse=True)
  assert three.stop_reason in ("end", "tokens")
  with pytest.raises(TypeError, match="drafts"):  # an option of Superposed only
    Pasta(drafts=3)
  with pytest.raises(PastaError, match="no n-gram index"):
    generate(model, ["q"], Superposed(ngram="/nonexistent/index"))


def test_corpus_index_counts_the_tokenized_documents(tmp_path):
  from pasta_jax.data.ngram_corpus import build_index, documents
  from pasta_jax.data.sources import DataError
  from tests.tiny import tiny_model
  tokenizer = tiny_model().tokenizer
  corpus = tmp_path / "notes.txt"
  corpus.write_text("the cat sat\n\nthe cat ran\n\n\n")
  index = build_index([str(corpus)], tokenizer, "tiny", progress=False)
  cat = tokenizer.encode("the cat", add_bos=False)
  assert index.meta["documents"] == 2 and index.count(np.asarray([cat]), np.asarray([len(cat)])).tolist() == [2]
  folder = index.save(tmp_path / "index")
  assert ngram.NgramIndex.load(folder).arrays.order.tolist() == index.arrays.order.tolist()
  with pytest.raises(DataError, match="evaluation set"):
    documents("alpaca_eval_805")


def test_a_batch_decodes_each_request_as_alone():
  """Requests share the loop but not their drafts: batched drafts equal one-request runs."""
  index = ngram.NgramIndex.build(CORPUS)
  rules = SuperposedRules(drafts=3, temperature=1.0)
  together = run(rules, PROMPTS, 9, index)
  for prompt, got in zip(PROMPTS, together, strict=True):
    [alone] = run(rules, [prompt], 9, index)
    assert got.rule_outputs["draft_tokens"] == alone.rule_outputs["draft_tokens"]
    assert got.finished == alone.finished


def test_pasta_eval_runs_superposed_decoding(tmp_path, monkeypatch):
  from pasta_jax.commands.eval_registry import build_method, parse_spec
  from pasta_jax.eval.methods import DecodeSettings
  from tests.tiny import tiny_model
  monkeypatch.setenv(ngram.ENV, str(tmp_path / "index"))  # the default index, built from the pools, goes here
  model = tiny_model()
  method = build_method(parse_spec("superposed"), DecodeSettings(max_new_tokens=6), lambda path: model)
  out = method.run({"id": "0", "instruction": "Name a fruit."})
  assert out.note == "best of 3 drafts" and out.content_tokens <= 6
  assert (tmp_path / "index" / "index.json").is_file()
