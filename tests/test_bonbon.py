"""The BoNBoN loss: the formula (against NumPy), alpha = 1 is SFT on y+, and training raises the margin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.data.encode import encode_example
from pasta_jax.lang.layout import stack_layouts
from pasta_jax.model.gemma import Gemma
from pasta_jax.training.bonbon import PairBatch, bonbon_loss, bonbon_objective
from pasta_jax.training.losses import sequence_logprob
from tests.tiny import tiny_model
from tests.training_data import ENCODE


def numpy_bonbon(pc, pr, rc, rr, alpha, beta):
  pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr))
  ipo = (np.log(np.exp(pc) / np.exp(pr)) - np.log(np.exp(rc) / np.exp(rr)) - 1.0 / beta) ** 2
  return float(np.mean(-alpha * pc + (1 - alpha) * ipo))


logps = st.lists(st.floats(-60.0, -0.1), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(logps, logps, logps, logps, st.sampled_from([0.0, 0.005, 0.5, 1.0]), st.sampled_from([0.05, 0.1, 1.0]))
def test_loss_equals_numpy_formula(pc, pr, rc, rr, alpha, beta):
  got = bonbon_loss(*(jnp.asarray(x, jnp.float64 if jax.config.x64_enabled else jnp.float32) for x in
                      (pc, pr, rc, rr)), alpha=alpha, beta=beta)
  want = numpy_bonbon(pc, pr, rc, rr, alpha, beta)
  np.testing.assert_allclose(float(got), want, rtol=1e-6, atol=1e-6 * max(1.0, abs(want)))


def _pair(model):
  vocab = model.tokenizer.tag_vocab()
  good = {"id": "g", "instruction": "List two", "annotated":
          'Two:<promise topic="a" tokens="10"/><async>one fish</async><promise topic="b" tokens="10"/>'
          '<async>two fish</async><sync/>done'}
  bad = {"id": "b", "instruction": "List two", "output": "one fish, two fish, red fish, blue fish. done"}
  chosen = stack_layouts([encode_example(good, model.tokenizer, vocab, ENCODE)])
  rejected = stack_layouts([encode_example(bad, model.tokenizer, vocab, ENCODE)])
  return chosen, rejected


def test_alpha_one_is_sft_on_the_chosen_answer():
  model = tiny_model()
  apply_fn = Gemma(model.config).apply
  chosen, rejected = _pair(model)
  batch = PairBatch(chosen, rejected, jnp.asarray([-3.0]), jnp.asarray([-7.0]))
  loss_fn = lambda p: bonbon_objective(apply_fn, p, batch, alpha=1.0, beta=0.1)[0]
  sft_fn = lambda p: -sequence_logprob(apply_fn, p, chosen).mean()
  (loss, grads), (sft, sft_grads) = jax.value_and_grad(loss_fn)(model.params), jax.value_and_grad(sft_fn)(model.params)
  np.testing.assert_allclose(float(loss), float(sft), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(sft_grads)):
    # fp32: the 2B batch sums in another order, so elements near zero differ by a few ulps of the leaf's
    # largest gradient (1.1e-5 on a leaf of magnitude ~20 was seen): tolerate that scale, nothing more
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=4e-6 * max(1.0, float(np.abs(b).max())))


def test_training_on_a_toy_pair_raises_the_margin():
  model = tiny_model()
  apply_fn = Gemma(model.config).apply
  chosen, rejected = _pair(model)
  ref = [float(sequence_logprob(apply_fn, model.params, x)[0]) for x in (chosen, rejected)]
  batch = PairBatch(chosen, rejected, jnp.asarray([ref[0]]), jnp.asarray([ref[1]]))
  optimizer = optax.adamw(1e-5)  # the random tiny model has huge logits: small steps
  params, state = model.params, optimizer.init(model.params)

  @jax.jit
  def step(params, state):
    (loss, aux), grads = jax.value_and_grad(
        lambda p: bonbon_objective(apply_fn, p, batch, alpha=0.005, beta=0.1), has_aux=True)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, aux

  margins = []
  for _ in range(5):
    params, state, aux = step(params, state)
    margins.append(float(aux["margin"]))
  gap = lambda p: float(sequence_logprob(apply_fn, p, chosen)[0] - sequence_logprob(apply_fn, p, rejected)[0])
  assert gap(params) > gap(model.params) + 1.0, margins  # log p(y+|x) - log p(y-|x) went up
  assert margins[-1] > margins[0] + 1.0, margins
