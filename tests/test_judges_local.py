"""The local-model judge on a tiny random model: one forward, softmax over the A/B next-token logits,
checked against an independent unjitted, unpadded forward; the clear errors; prompt truncation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.judges import LocalJudge, LocalJudgeError, judge_both_orders, local
from pasta_jax.model.gemma import Gemma, causal_mask
from pasta_jax.model.load import LoadedModel
from tests.tiny import TEXT_BASE, tiny_model

END = "Reply with A or B only.<end_of_turn>\n<start_of_turn>model\n"  # the next token is the letter


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def softmax_a(logits, a, b) -> float:
  """P(A) written out independently of local.p_first."""
  ea, eb = np.exp(np.float64(logits[a])), np.exp(np.float64(logits[b]))
  return float(ea / (ea + eb))


def test_p_first_is_the_softmax_of_the_reference_forward(model):
  judge = LocalJudge(model)
  assert (judge.a_id, judge.b_id) == (TEXT_BASE + ord("A"), TEXT_BASE + ord("B"))
  verdict = judge.compare("Which fruit?", "apple", "pear")
  assert 0.0 < verdict.p_first < 1.0
  ids = judge.prompt_ids("Which fruit?", "apple", "pear")
  assert model.tokenizer.decode(ids).endswith(END)
  n = len(ids)  # unpadded, unjitted: the padded bucket must not change the last position's logits
  logits = Gemma(model.config).apply(model.params, jnp.asarray([ids]), jnp.arange(n)[None], causal_mask(1, n)).logits
  expected = softmax_a(np.asarray(logits[0, -1]), judge.a_id, judge.b_id)
  assert verdict.p_first == pytest.approx(expected, rel=1e-5)
  both = judge_both_orders(judge, "Which fruit?", "apple", "pear")
  assert 0.0 < both < 1.0 and judge.name == f"local:{model.source}:{local.prompt.PROMPT_VERSION}"


def test_lengths_in_one_bucket_share_a_compile(model):
  judge = LocalJudge(model)
  judge.compare("q", "a", "b")
  run = local._last_logits_fn(model.config, jnp.float32)
  before = run._cache_size()
  judge.compare("q", "ab", "b")
  judge.compare("q", "a", "bcd")  # a few more tokens, the same power-of-two bucket
  assert run._cache_size() == before


def test_softmax_math_with_stub_logits(model, monkeypatch):
  judge = LocalJudge(model)
  logits = np.zeros(model.config.vocab_size, np.float32)
  logits[judge.a_id], logits[judge.b_id], logits[7] = 2.0, -1.0, 50.0  # other tokens do not count
  monkeypatch.setattr(judge, "next_token_logits", lambda ids: logits)
  assert judge.compare("q", "a", "b").p_first == pytest.approx(1 / (1 + np.exp(-3.0)), rel=1e-12)
  logits[judge.a_id], logits[judge.b_id] = 1000.0, -1000.0  # no overflow
  assert judge.compare("q", "a", "b").p_first == 1.0
  assert local.p_first(np.array([0.0, 3.0, 3.0]), 1, 2) == 0.5


def test_long_prompts_lose_their_answers_tails_alike(model):
  judge = LocalJudge(model, max_prompt_tokens=900)  # about 450 tokens besides the answers
  full = judge.prompt_ids("q", "x" * 400, "y" * 900)
  assert len(full) <= 900
  text = model.tokenizer.decode(full)
  assert text.count(local.TRUNCATED) == 2 and text.endswith(END)
  assert text.count("x") > 100 and text.count("x") / 400 == pytest.approx(text.count("y") / 900, abs=0.01)  # alike
  huge = judge.prompt_ids("q" * 2000, "a", "b")  # the instruction alone is too long: the middle goes
  assert len(huge) == 900 and model.tokenizer.decode(huge).endswith(END)


class Tokenizer:
  hf = None

  def __init__(self, ids):
    self.ids = ids

  def encode(self, text, add_bos=True):
    return self.ids[text]


def test_tokenizer_without_single_letter_tokens_is_refused():
  with pytest.raises(LocalJudgeError, match=r"no single token for 'A' \(it encodes to \[5, 6\]\)"):
    local.letter_ids(Tokenizer({"A": [5, 6], "B": [7]}))
  with pytest.raises(LocalJudgeError, match="same id 5"):
    local.letter_ids(Tokenizer({"A": [5], "B": [5]}))


def test_model_without_tokenizer_is_refused(model):
  with pytest.raises(LocalJudgeError, match="needs a model with a tokenizer; bare has none"):
    LocalJudge(LoadedModel(model.config, model.params, None, "bare"))
