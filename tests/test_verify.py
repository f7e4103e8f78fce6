"""The model-verified filter: the share of next-token predictions that change without the blocks'
context, against an independent count from two separate forwards; and the keep/reject rules."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pasta_jax.data import verify as V
from pasta_jax.methods import Pasta, Sequential, generate
from tests.tiny import tiny_model

MODEL = tiny_model()
ANNOTATED = ('Fruits:<promise topic="a" tokens="10"/><async> apples are red and sweet</async>'
             '<promise topic="b" tokens="10"/><async> pears are green</async><sync/> Both are good.')


def sharp_model(scale: float = 0.3):
  """The tiny model with its weights redrawn larger: its greedy predictions depend on context (the stock
  tiny model predicts one token everywhere, so every count of changed predictions would be 0)."""
  leaves, treedef = jax.tree.flatten(MODEL.params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  drawn = [jax.random.normal(k, x.shape, x.dtype) * scale if x.ndim >= 2 else x for k, x in zip(keys, leaves)]
  return MODEL._replace(params=jax.tree.unflatten(treedef, drawn))


def predictions_by_content_index(result, vocab) -> dict[int, int]:
  """From an interpreter run's records and logits: content index k (in the tag-free answer's order) ->
  the greedy prediction behind content token k, kept only where the token its thread fed before it
  was content token k - 1 (so both sides predict the same next token from the same last token)."""
  records, logits = result.records, result.logits
  per_thread: dict[int, list[int]] = {}
  for i, thread in enumerate(records[:, 2]):
    per_thread.setdefault(int(thread), []).append(i)
  order, forks_spawned, in_topic = [], 0, False  # record indices of content tokens, in answer order
  for i in per_thread[0]:
    token = int(records[i, 3])
    if token == vocab.promise:
      in_topic = True
    elif vocab.is_length(token):
      in_topic, forks_spawned = False, forks_spawned + 1
      order += [j for j in per_thread[forks_spawned] if int(records[j, 3]) not in vocab.tag_ids]
    elif not in_topic and token not in vocab.tag_ids and token not in vocab.eos_ids:
      order.append(i)
  previous = {j: i for rows in per_thread.values() for i, j in zip(rows[:-1], rows[1:])}
  return {k: int(np.argmax(logits[j])) for k, j in enumerate(order)
          if k > 0 and previous.get(j) == order[k - 1]}


def test_changed_share_matches_an_independent_count():
  """The filter's count from two training-layout forwards equals a count made with the interpreter
  instead: the annotated answer replayed with PASTA and its tag-free text replayed sequentially,
  comparing the logits the interpreter recorded behind each content token."""
  from pasta_jax.lang.text import strip_tags
  model = sharp_model()
  vocab = model.tokenizer.tag_vocab()
  verdict = V.verify({"instruction": "Name fruits.", "annotated": ANNOTATED}, model,
                     V.VerifyConfig(max_changed=1.01, min_speedup=0.0))
  [pasta] = generate(model, ["Name fruits."], Pasta(), forced_answers=[ANNOTATED], return_logits=True, max_new_tokens=8)
  [plain] = generate(model, ["Name fruits."], Sequential(), forced_answers=[strip_tags(ANNOTATED)], return_logits=True,
                     max_new_tokens=8)
  a, b = predictions_by_content_index(pasta, vocab), predictions_by_content_index(plain, vocab)
  compared = sorted(set(a) & set(b))
  assert len(compared) > 40  # most content tokens are compared (block openings and main after a sync are not)
  want = np.mean([a[k] != b[k] for k in compared])
  assert 0 < want < 0.5  # the sharp model changes some predictions, not most
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
