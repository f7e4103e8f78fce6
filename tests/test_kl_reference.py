"""The SFT KL term toward a reference model: the tags left out of it, and a reference adapter (Baseline-SFT)
instead of the frozen base."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.errors import ConfigError
from pasta_jax.lang import layout as lay
from pasta_jax.model import lora
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.losses import KlTags, in_text_order, sft_kl_loss_sum
from pasta_jax.training.metrics_log import read_metrics
from pasta_jax.training.trainer import Trainer
from tests import training_data
from tests.lang_helpers import BOS, HAND_ANSWER, VOCAB, token_programs
from tests.tiny import tiny_model
from tests.train_worker import cyclic

V = 7
TAGS = (5, 6)  # two "tag" ids of the toy vocabulary


def _fixed_logits(logits):
  return lambda params, tokens, positions, mask: types.SimpleNamespace(logits=jnp.asarray(logits))


PROMPT = [BOS, 90]


def _batch(targets, loss_mask):
  targets = jnp.asarray(targets, jnp.int32)
  return types.SimpleNamespace(tokens=targets, positions=targets, targets=targets, thread=jnp.zeros_like(targets),
                               loss_mask=jnp.asarray(loss_mask), thread_mask=lambda: None)


def _numpy_kl(p_logits, q_logits, keep):
  p = np.exp(p_logits[..., keep]) / np.exp(p_logits[..., keep]).sum(-1, keepdims=True)
  q = np.exp(q_logits[..., keep]) / np.exp(q_logits[..., keep]).sum(-1, keepdims=True)
  return (p * (np.log(p) - np.log(q))).sum(-1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tag_shift=st.floats(-20, 20))
def test_the_kl_is_over_the_text_only_and_skips_positions_whose_target_is_a_tag(seed, tag_shift):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(2, 5, V)).astype(np.float32)
  reference = rng.normal(size=(2, 5, V)).astype(np.float32)
  targets = rng.integers(0, V, size=(2, 5))
  loss_mask = rng.random((2, 5)) < 0.8
  batch = _batch(targets, loss_mask)
  run = lambda ref, excluded: sft_kl_loss_sum(_fixed_logits(logits), _fixed_logits(ref), None, None, batch, 1.0,
                                              KlTags(excluded=excluded))[2]["kl"]
  keep = [i for i in range(V) if i not in TAGS]
  counted = loss_mask & ~np.isin(targets, TAGS)
  expected = (_numpy_kl(logits, reference, keep) * counted).sum() / max(counted.sum(), 1)
  np.testing.assert_allclose(float(run(reference, TAGS)), expected, rtol=1e-4, atol=1e-6)
  # the reference's mass on the tags does not count: a reference that differs only there is no distance
  only_tags_differ = logits.copy()
  only_tags_differ[..., list(TAGS)] += tag_shift
  assert float(run(only_tags_differ, TAGS)) == pytest.approx(0.0, abs=1e-5)
  if abs(tag_shift) > 1:
    assert float(run(only_tags_differ, ())) > 1e-4  # over the whole vocabulary it is


def test_the_kl_gradient_is_finite_with_tags_left_out():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, V)), jnp.float32)
  batch = _batch([[0, 5, 2, 3]], [[True, True, True, True]])
  reference = _fixed_logits(jnp.zeros((1, 4, V)))

  def loss(x):
    return sft_kl_loss_sum(lambda *a: types.SimpleNamespace(logits=x), reference, None, None, batch, 0.5,
                           KlTags(excluded=TAGS))[0]

  assert np.isfinite(np.asarray(jax.grad(loss)(logits))).all()


def _reference_adapter(folder, model):
  """An adapter that moves the tiny model (B non-zero), saved as a folder like Baseline-SFT's."""
  config = lora.AdapterConfig(rank=2, alpha=4.0, targets=("q", "v", "up"))
  tree = lora.init_adapter(model.params, config, jax.random.key(3))
  tree = jax.tree_util.tree_map_with_path(
    lambda path, x: jax.random.normal(jax.random.key(len(path)), x.shape) * 0.5
    if str(path[-1].key).endswith(lora.B_SUFFIX) else x, tree)
  return lora.save_adapter(folder, tree, config, base="tiny")


def _trainer(out_dir, steps: int, **fields):
  model = tiny_model()
  config = TrainConfig(model="tiny", batch_size=4, seq_len=112, num_threads=4, learning_rate=1e-2, save_every=100,
                       lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS, **fields)
  trainer = Trainer(config, model, cyclic(training_data.batches(model.tokenizer), steps), out_dir,
                    check_memory=False, progress=False)
  trainer._mfu = lambda tokens, seconds: 0.0
  return trainer


def test_a_kl_toward_a_reference_adapter_starts_at_their_distance_and_holds_the_model_near_it(tmp_path):
  reference = _reference_adapter(tmp_path / "reference", tiny_model())
  kls = {}
  for weight in (1e-6, 5.0):  # the KL to the reference is logged in both; only the second pulls
    _trainer(tmp_path / str(weight), steps=6, kl_weight=weight, kl_reference=str(reference)).run()
    kls[weight] = [row["kl"] for row in read_metrics(tmp_path / str(weight))]
  # a fresh adapter is the base, which the reference moved: the KL starts at their distance (toward the base
  # it would start at exactly 0)
  assert kls[5.0][0] == pytest.approx(kls[1e-6][0]) and kls[5.0][0] > 1e-3
  # the SFT data alone carries the model away from the reference (0.29 -> 0.59); the term holds it near
  assert kls[1e-6][-1] > 1.5 * kls[1e-6][0]
  assert kls[5.0][-1] < kls[5.0][0] and kls[5.0][-1] < 0.3 * kls[1e-6][-1]


def test_a_kl_reference_is_refused_without_a_weight_or_over_another_model(tmp_path):
  with pytest.raises(ConfigError, match="kl_reference"):
    TrainConfig(lora_rank=4, kl_reference="somewhere")
  other = tiny_model("tiny-gemma1")
  folder = lora.save_adapter(tmp_path / "other", lora.init_adapter(other.params, lora.AdapterConfig(rank=2),
                                                                  jax.random.key(0)),
                             lora.AdapterConfig(rank=2), base="other")
  with pytest.raises(Exception, match="another model"):
    _trainer(tmp_path / "run", steps=2, kl_weight=1.0, kl_reference=str(folder))
  with pytest.raises(ConfigError, match="neither a shipped adapter"):
    _trainer(tmp_path / "run", steps=2, kl_weight=1.0, kl_reference=str(tmp_path / "nowhere"))


# --- which positions the KL counts: text order -------------------------------------------------------------
def _expected_text_order(prompt: list[int], answer: list[int]) -> list[bool]:
  """Walks the answer's text form: a promise's topic and length, and main after a block until the next sync,
  are out of text order; a block's content and main elsewhere are in it."""
  flags, topic, skipping, in_block = [True] * len(prompt), False, False, False
  for token in answer:
    if token == VOCAB.async_open:
      in_block = True
    if in_block:
      flags.append(True)
      in_block = token != VOCAB.async_close
      continue
    topic = (topic or token == VOCAB.promise) and not VOCAB.is_length(token)
    skipping = (skipping or VOCAB.is_length(token)) and token != VOCAB.sync
    flags.append(not (topic or skipping or token == VOCAB.promise))
  return flags + [not skipping]  # the end id


def _text_order(prompt, answer) -> list[bool]:
  out = lay.layout_example(prompt, answer, VOCAB)
  order = in_text_order(jnp.asarray(out.tokens), jnp.asarray(out.thread), KlTags.of(VOCAB))
  return np.asarray(order).tolist()


def test_the_kl_counts_main_in_text_order_and_every_block_hand_example():
  flags = _text_order(PROMPT, HAND_ANSWER)  # a P t L10 [A x /A] b P L20 [A y z /A] S c P L10 [A w /A] d EOS
  out_of_order = {3, 4, 5, 9, 10, 11, 18, 19, 23, 24}  # topics and lengths; b..L20 and d before their sync
  assert [i for i, f in enumerate(flags) if not f] == sorted(out_of_order)


@settings(max_examples=60, deadline=None)
@given(answer=token_programs())
def test_the_kl_counts_main_in_text_order_and_every_block(answer):
  assert _text_order(PROMPT, answer) == _expected_text_order(PROMPT, answer)


def test_the_kl_term_counts_only_positions_in_text_order():
  out = lay.layout_example(PROMPT, HAND_ANSWER, VOCAB)
  vocab_size = 96  # the toy ids: tags 3..58, text 70..78, the prompt's 90
  rng = np.random.default_rng(0)
  logits, reference = (rng.normal(size=(1, len(out.tokens), vocab_size)).astype(np.float32) for _ in range(2))
  batch = types.SimpleNamespace(tokens=jnp.asarray(out.tokens[None]), positions=jnp.asarray(out.positions[None]),
                                targets=jnp.asarray(out.targets[None]), thread=jnp.asarray(out.thread[None]),
                                loss_mask=jnp.asarray(out.loss_mask[None]), thread_mask=lambda: None)
  tags = KlTags.of(VOCAB)
  got = sft_kl_loss_sum(_fixed_logits(logits), _fixed_logits(reference), None, None, batch, 1.0, tags)[2]["kl"]
  keep = [i for i in range(vocab_size) if i not in tags.excluded]
  counted = out.loss_mask & ~np.isin(out.targets, tags.excluded) & _expected_text_order(PROMPT, HAND_ANSWER)
  assert counted.sum() == 6  # the prompt's end (-> a), the blocks' <async> (-> x, y, w), y (-> z), the sync (-> c)
  expected = (_numpy_kl(logits, reference, keep)[0] * counted).sum() / counted.sum()
  np.testing.assert_allclose(float(got), expected, rtol=1e-4)
