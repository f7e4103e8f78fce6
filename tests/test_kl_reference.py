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
from pasta_jax.model import lora
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.losses import sft_kl_loss_sum
from pasta_jax.training.metrics_log import read_metrics
from pasta_jax.training.trainer import Trainer
from tests import training_data
from tests.tiny import tiny_model
from tests.train_worker import cyclic

V = 7
TAGS = (5, 6)  # two "tag" ids of the toy vocabulary


def _fixed_logits(logits):
  return lambda params, tokens, positions, mask: types.SimpleNamespace(logits=jnp.asarray(logits))


def _batch(targets, loss_mask):
  targets = jnp.asarray(targets, jnp.int32)
  return types.SimpleNamespace(tokens=targets, positions=targets, targets=targets,
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
                                              excluded)[2]["kl"]
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
    return sft_kl_loss_sum(lambda *a: types.SimpleNamespace(logits=x), reference, None, None, batch, 0.5, TAGS)[0]

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
  # the SFT data alone carries the model away from the reference (0.34 -> 1.7); the term holds it near (0.24)
  assert kls[1e-6][-1] > 2 * kls[1e-6][0]
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
