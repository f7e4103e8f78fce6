"""Superposed inputs: a step may feed weighted mixes of token embeddings instead of token ids (the hook
Superposed Decoding needs), through the one driver, with no case of its own on the shared path.

Oracles: for Gemma, the same model with one embedding row overwritten by the mix and fed that row's id;
for the step driver, a full-recompute greedy loop that feeds the same mixes to the model without a pool.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.rules.sequential import SequentialRules
from pasta_jax.decode.state import TOKEN
from pasta_jax.decode.toy_model import toy_apply, toy_params
from pasta_jax.model.gemma import Gemma, causal_mask
from tests.programs import VOCAB, VOCAB_SIZE
from tests.test_interpreter_vs_reference import POOL_SPEC, TOY
from tests.tiny import tiny_model

PARTNER = 7  # the token mixed into every fed row
PARAMS = toy_params(TOY, {}, seed=2)  # no tag bias: greedy text varies with the input


@dataclasses.dataclass(frozen=True)
class MixedSequentialRules(SequentialRules):
  """Sequential decoding that feeds (1 - alpha) * embed(pending) + alpha * embed(PARTNER)."""

  name: ClassVar[str] = "mixed-sequential"
  alpha: float = 0.0

  def feed_inputs(self, state, rows_lane, cfg):
    pending, _ = super().feed_inputs(state, rows_lane, cfg)  # [B, Q]
    ids = jnp.stack([pending, jnp.full_like(pending, PARTNER)], axis=-1)  # [B, Q, 2]
    weights = jnp.broadcast_to(jnp.asarray([1.0 - self.alpha, self.alpha]), ids.shape)
    return ids, weights


def decode(rules, prompts, steps=10):
  cfg = InterpreterConfig(vocab=VOCAB, lanes=1, max_threads=1, pool_slots=32, max_steps=steps, rules=rules)
  runs = run_interpreter(toy_apply, PARAMS, prompts, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  return [r.records[:, TOKEN].tolist() for r in runs]


def recompute_greedy(prompt, alpha, steps=10):
  """The oracle: each step reruns the whole sequence without a pool; prompt rows are plain, every
  generated row (the prefill's token on) is the mix the rules feed."""
  out = []
  for _ in range(steps + 1):
    seq = list(prompt) + out
    n = len(seq)
    ids = np.stack([seq, [PARTNER] * n], axis=-1)[None]  # [1, n, 2]
    weights = np.array([[1.0, 0.0]] * len(prompt) + [[1.0 - alpha, alpha]] * len(out), np.float32)[None]
    positions = jnp.arange(n)[None]
    logits = toy_apply(PARAMS, jnp.asarray(ids), positions, causal_mask(1, n),
                       token_weights=jnp.asarray(weights)).logits
    out.append(int(jnp.argmax(logits[0, -1])))
  return out


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_a_zero_weight_partner_is_plain_sequential_decoding():
  plain = decode(SequentialRules(ignore_eos=True), PROMPTS)
  assert decode(MixedSequentialRules(ignore_eos=True, alpha=0.0), PROMPTS) == plain


@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_the_driver_feeds_the_mix_the_rules_give(alpha):
  got = decode(MixedSequentialRules(ignore_eos=True, alpha=alpha), PROMPTS)
  assert got == [recompute_greedy(p, alpha)[:len(g)] for p, g in zip(PROMPTS, got, strict=True)]
  assert got != decode(SequentialRules(ignore_eos=True), PROMPTS)  # the mix is live, not dropped


MODEL = tiny_model()


@jax.jit
def _gemma(params, tokens, weights):
  n = tokens.shape[1]
  mask = causal_mask(1, n)
  return Gemma(MODEL.config).apply(params, tokens, jnp.arange(n)[None], mask, token_weights=weights).logits


@settings(max_examples=3, deadline=None)
@given(a=st.integers(200, 227), b=st.integers(200, 227), w=st.floats(-1.0, 2.0))
def test_gemma_sums_the_weighted_embeddings(a, b, w):
  """Feeding ids (a, b) with weights (w, 1 - w) == feeding one id whose embedding row is that sum."""
  row = 3  # a row no input uses
  table = MODEL.params["params"]["embedder"]
  mixed_row = w * table[a] + (1 - w) * table[b]
  params = jax.tree.map(lambda x: x, MODEL.params)
  params["params"]["embedder"] = table.at[row].set(mixed_row)
  plain_ids = jnp.asarray([[120, row, 130]])
  ids = jnp.asarray([[[120, 120], [a, b], [130, 130]]])
  weights = jnp.asarray([[[1.0, 0.0], [w, 1 - w], [0.5, 0.5]]])
  want = _gemma(params, plain_ids, None)
  got = _gemma(params, ids, weights)
  keep = np.arange(want.shape[-1]) != row  # the tied head's row moved with the table
  np.testing.assert_allclose(np.asarray(got)[..., keep], np.asarray(want)[..., keep], rtol=1e-5, atol=1e-5)


def test_gemma_refuses_mismatched_weights():
  ids = jnp.zeros((1, 2, 3), jnp.int32)
  with pytest.raises(ValueError, match="token_weights"):
    _gemma(MODEL.params, ids, jnp.ones((1, 2, 2)))
  with pytest.raises(ValueError, match="token_weights"):
    _gemma(MODEL.params, ids, None)
