"""The resumable judge cache (an interrupted run never judges a pair twice) and the local-model judge
(one forward, softmax over the A/B logits)."""

from __future__ import annotations

import numpy as np
import pytest

from pasta_jax.errors import PastaError
from pasta_jax.judges import CachedJudge, LocalJudge, Verdict, judge_both_orders, local
from tests.tiny import tiny_model

PAIRS = [("q1", "a", "b"), ("q1", "b", "a"), ("q2", "x", "y"), ("q3", "long answer", "short")]


class Counting:
  name = "counting"

  def __init__(self, fail_after=None):
    self.calls, self.fail_after = [], fail_after

  def compare(self, instruction, first, second):
    if self.fail_after is not None and len(self.calls) >= self.fail_after:
      raise KeyboardInterrupt("killed")
    self.calls.append((instruction, first, second))
    return Verdict(len(first) / (len(first) + len(second)), "raw")


def test_interrupted_run_resumes_without_judging_twice(tmp_path):
  path = tmp_path / "verdicts.jsonl"
  first = Counting(fail_after=2)
  judge = CachedJudge(first, path)
  with pytest.raises(KeyboardInterrupt):
    for pair in PAIRS:
      judge.compare(*pair)
  with open(path, "a") as f:
    f.write('{"key": "half-writ')  # the kill cut a line in half
  second = Counting()
  resumed = CachedJudge(second, path)
  got = [resumed.compare(*pair).p_first for pair in PAIRS]
  assert got == [Counting().compare(*pair).p_first for pair in PAIRS]
  assert not set(first.calls) & set(second.calls) and len(first.calls) + len(second.calls) == len(PAIRS)
  assert (resumed.hits, resumed.misses) == (2, 2)
  again = Counting()
  assert [CachedJudge(again, path).compare(*p).p_first for p in PAIRS] == got and again.calls == []


def test_a_different_judge_does_not_reuse_verdicts(tmp_path):
  CachedJudge(Counting(), tmp_path / "v.jsonl").compare(*PAIRS[0])
  other = Counting()
  other.name = "another"
  CachedJudge(other, tmp_path / "v.jsonl").compare(*PAIRS[0])
  assert len(other.calls) == 1


def test_local_judge_softmax_over_letters(monkeypatch):
  model = tiny_model()
  monkeypatch.setattr(local, "letter_ids", lambda tok: (100 + ord("A"), 100 + ord("B")))
  judge = LocalJudge(model)
  verdict = judge.compare("Which fruit?", "apple", "pear")
  assert 0.0 < verdict.p_first < 1.0
  ids = local.prompt_ids(model.tokenizer, [local.prompt.local_prompt("Which fruit?", "apple", "pear")], True)[0]
  tokens = np.zeros((1, local.bucket(len(ids))), np.int32)
  tokens[0, :len(ids)] = ids
  import jax.numpy as jnp
  logits = np.asarray(local._last_logits_fn(model.config, jnp.float32)(model.params, jnp.asarray(tokens),
                                                                         jnp.int32(len(ids))), np.float64)
  a, b = logits[100 + ord("A")], logits[100 + ord("B")]
  assert verdict.p_first == pytest.approx(1 / (1 + np.exp(b - a)), rel=1e-9)
  both = judge_both_orders(judge, "Which fruit?", "apple", "pear")
  assert 0.0 < both < 1.0


def test_local_judge_padding_does_not_change_the_logits():
  """The bucketed (padded) forward gives the unpadded forward's last-token logits."""
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma, causal_mask
  model = tiny_model()
  ids = local.prompt_ids(model.tokenizer, ["hello"], True)[0]
  tokens = np.zeros((1, local.bucket(len(ids))), np.int32)
  tokens[0, :len(ids)] = ids
  padded = np.asarray(local._last_logits_fn(model.config, jnp.float32)(model.params, jnp.asarray(tokens),
                                                                         jnp.int32(len(ids))))
  n = len(ids)
  logits, _ = Gemma(model.config).apply(model.params, jnp.asarray([ids]), jnp.arange(n)[None], causal_mask(1, n))
  np.testing.assert_allclose(padded, np.asarray(logits[0, -1]), rtol=1e-5, atol=1e-5)


def test_local_judge_needs_single_letter_tokens():
  class Multi:
    def encode(self, text, add_bos=True):
      return [5, 6]

    hf = None

  with pytest.raises(PastaError, match="no single token for 'A'"):
    local.letter_ids(Multi())
