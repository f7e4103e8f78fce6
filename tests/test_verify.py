"""The model-verified filter: the share of next-token predictions that change without the blocks'
context, against an independent count from two separate forwards; and the keep/reject rules."""

from __future__ import annotations

import numpy as np
import pytest

from pasta_jax.data import verify as V
from tests.tiny import tiny_model

MODEL = tiny_model()
ANNOTATED = ('Fruits:<promise topic="a" tokens="10"/><async> apples are red and sweet</async>'
             '<promise topic="b" tokens="10"/><async> pears are green</async><sync/> Both are good.')


def test_changed_share_matches_an_independent_count():
  record = {"instruction": "Name fruits.", "annotated": ANNOTATED}
  verdict = V.verify(record, MODEL, V.VerifyConfig(max_changed=1.01, min_speedup=0.0))
  # Independently: run both forwards here and pick the content rows by hand (character ids >= 100,
  # skipping the one-character topics right after each PROMISE).
  from pasta_jax.data.encode import end_id, prompt_token_ids
  from pasta_jax.decode.api import LangTokenizer
  from pasta_jax.lang.layout import layout_example, plain_layout
  from pasta_jax.lang.tokens import encode_answer, strip_token_ids
  vocab = MODEL.tokenizer.tag_vocab()
  prompt = prompt_token_ids(MODEL.tokenizer, "Name fruits.", True)
  ids = encode_answer(ANNOTATED, LangTokenizer(MODEL.tokenizer), vocab)
  end = end_id(MODEL.tokenizer, vocab, True)
  pasta, plain = layout_example(prompt, ids, vocab, eos_id=end), plain_layout(prompt, strip_token_ids(ids, vocab), end)
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma
  apply = Gemma(MODEL.config).apply
  pa = np.argmax(np.asarray(apply(MODEL.params, jnp.asarray(pasta.tokens)[None], jnp.asarray(pasta.positions)[None],
                                  pasta.mask()[None])[0][0]), -1)
  pl = np.argmax(np.asarray(apply(MODEL.params, jnp.asarray(plain.tokens)[None], jnp.asarray(plain.positions)[None],
                                  plain.mask()[None])[0][0]), -1)
  topics = (100 + ord("a"), 100 + ord("b"))
  pasta_rows = [i for i in range(len(prompt), len(pasta.tokens)) if pasta.tokens[i] >= 100
                and not (pasta.tokens[i] in topics and pasta.tokens[i - 1] == vocab.promise)]
  plain_rows = [i for i in range(len(prompt), len(plain.tokens)) if plain.tokens[i] >= 100]
  assert len(pasta_rows) == len(plain_rows)
  pairs = [(a, b) for a, b in zip(pasta_rows, plain_rows)
           if pasta.targets[a] == plain.targets[b] and plain.targets[b] >= 100]
  want = np.mean([pa[a] != pl[b] for a, b in pairs])
  assert verdict.changed == pytest.approx(want)
  assert verdict.speedup > 1.2


def test_keep_and_reject_rules(monkeypatch):
  record = {"instruction": "Name fruits.", "annotated": ANNOTATED}
  # The tiny model predicts the same either way (changed = 0, so a threshold of 0 rejected whatever the
  # rule did): test the threshold on predictions that differ on every compared row instead (the PASTA
  # forward "predicts" its row index, the plain forward 0).
  real = V._predictions
  monkeypatch.setattr(V, "_predictions",
                      lambda model, layout: np.arange(len(layout.tokens)) * (layout.num_threads > 1))
  changed = V.verify(record, MODEL, V.VerifyConfig(max_changed=1.01, min_speedup=0.0)).changed
  assert changed == 1.0  # every compared row differs
  strict = V.verify(record, MODEL, V.VerifyConfig(max_changed=changed, min_speedup=0.0))
  assert not strict.keep and "change without the blocks' context" in strict.reason
  assert V.verify(record, MODEL, V.VerifyConfig(max_changed=changed + 1e-6, min_speedup=0.0)).keep
  monkeypatch.setattr(V, "_predictions", real)
  slow = V.verify(record, MODEL, V.VerifyConfig(max_changed=1.01, min_speedup=10.0))
  assert not slow.keep and "theoretical speedup" in slow.reason
  assert V.verify(record, MODEL, V.VerifyConfig(max_changed=1.01, min_speedup=1.0)).keep
  plain = V.verify({"instruction": "Hi", "annotated": "no blocks here at all"}, MODEL)
  assert plain.changed == 0.0 and not plain.keep  # nothing changes, but no speedup either


@pytest.mark.parametrize("near_miss", ["<sync />", "<promise topic='a' tokens='10'/>", "< async>", "</ASYNC>"])
def test_near_miss_tags_are_rejected_not_trained_as_words(near_miss):
  from pasta_jax.lang.text import near_misses
  annotated = ANNOTATED.replace("<sync/>", near_miss) if near_miss == "<sync />" else ANNOTATED + near_miss
  assert near_misses(annotated) == [near_miss] and near_misses(ANNOTATED) == []
  verdict = V.verify({"instruction": "Name fruits.", "annotated": annotated}, MODEL)
  assert not verdict.keep and near_miss in verdict.reason
