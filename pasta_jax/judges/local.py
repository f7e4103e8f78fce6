"""A judge that runs any pasta_jax model: one forward over the judging prompt, softmax over the
next-token logits of "A" and "B"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.api import LangTokenizer, model_fn, prompt_ids
from pasta_jax.decode.plain import bucket
from pasta_jax.errors import PastaError
from pasta_jax.judges import prompt
from pasta_jax.judges.base import Verdict
from pasta_jax.model.gemma import causal_mask


def letter_ids(tokenizer) -> tuple[int, int]:
  lang = LangTokenizer(tokenizer)
  ids = []
  for letter in ("A", "B"):
    encoded = lang.encode(letter)
    if len(encoded) != 1:
      raise PastaError(f"the tokenizer has no single token for {letter!r}: a local judge cannot read its verdict")
    ids.append(encoded[0])
  return ids[0], ids[1]


def p_first(logits: np.ndarray, a_id: int, b_id: int) -> float:
  """softmax over the two letters' logits -> P(A)."""
  pair = np.array([logits[a_id], logits[b_id]], np.float64)
  pair = np.exp(pair - pair.max())
  return float(pair[0] / pair.sum())


@functools.lru_cache(maxsize=4)
def _last_logits_fn(config, dtype):
  apply = model_fn(config, dtype)

  @jax.jit
  def run(params, tokens, length):
    width = tokens.shape[1]
    positions = jnp.arange(width, dtype=jnp.int32)[None]
    logits, _ = apply(params, tokens, positions, causal_mask(1, width, length[None]), None, None, None)
    return logits[0, length - 1]

  return run


class LocalJudge:
  def __init__(self, model, max_prompt_tokens: int = 4096, chat: bool = True):
    if model.tokenizer is None:
      raise PastaError("a local judge needs a model with a tokenizer")
    self.model, self.max_prompt_tokens, self.chat = model, max_prompt_tokens, chat
    self.a_id, self.b_id = letter_ids(model.tokenizer)
    self.name = f"local:{model.source}:{prompt.PROMPT_VERSION}"

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    ids = prompt_ids(self.model.tokenizer, [prompt.local_prompt(instruction, first, second)], self.chat)[0]
    if len(ids) > self.max_prompt_tokens:
      ids = ids[: self.max_prompt_tokens // 2] + ids[-self.max_prompt_tokens // 2:]  # keep the question's end
    tokens = np.zeros((1, bucket(len(ids))), np.int32)  # powers of two: few compiles
    tokens[0, : len(ids)] = ids
    logits = _last_logits_fn(self.model.config, jnp.float32)(self.model.params, jnp.asarray(tokens),
                                                               jnp.int32(len(ids)))
    return Verdict(p_first(np.asarray(logits), self.a_id, self.b_id))
