"""A judge that runs any pasta_jax model: one forward over the judging prompt, softmax over the
next-token logits of "A" and "B".

The prompt is chat-formatted so it ends by opening the model's turn: the very next token is the
verdict, so one forward (no sampling, no decode loop) gives a soft P(A). Prompts are padded to
power-of-two lengths so that a whole evaluation compiles the forward only a handful of times.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.api import LangTokenizer, prompt_ids
from pasta_jax.decode.loop import bucket
from pasta_jax.errors import PastaError
from pasta_jax.judges import prompt
from pasta_jax.judges.base import Verdict
from pasta_jax.model.gemma import Gemma, causal_mask

TRUNCATED = " [...]"


class LocalJudgeError(PastaError):
  """The model cannot serve as a local judge (no tokenizer, no single-token letters)."""


def letter_ids(tokenizer) -> tuple[int, int]:
  """The token ids of "A" and "B" as the model would write them first in its turn."""
  lang = LangTokenizer(tokenizer)
  ids = []
  for letter in ("A", "B"):
    encoded = lang.encode(letter)
    if len(encoded) != 1:
      raise LocalJudgeError(f"the tokenizer has no single token for {letter!r} (it encodes to {encoded}): "
                            "a local judge cannot read its verdict from one next-token distribution")
    ids.append(encoded[0])
  if ids[0] == ids[1]:
    raise LocalJudgeError(f"the tokenizer gives 'A' and 'B' the same id {ids[0]}: a local judge cannot tell them apart")
  return ids[0], ids[1]


def p_first(logits: np.ndarray, a_id: int, b_id: int) -> float:
  """softmax over the two letters' logits -> P(A) (in float64: bf16 logits would round it coarsely)."""
  pair = np.array([logits[a_id], logits[b_id]], np.float64)
  pair = np.exp(pair - pair.max())
  return float(pair[0] / pair.sum())


@functools.lru_cache(maxsize=4)
def _last_logits_fn(config, dtype):
  """Jitted forward -> the logits at position length-1; `length` is traced, so one compile per bucket."""
  apply = Gemma(config, dtype=jnp.dtype(dtype)).apply  # one full forward: the training layout, model.params

  @jax.jit
  def run(params, tokens, length):
    width = tokens.shape[1]
    positions = jnp.arange(width, dtype=jnp.int32)[None]
    logits = apply(params, tokens, positions, causal_mask(1, width, length[None])).logits
    return logits[0, length - 1]

  return run


def next_token_logits(model, ids: list[int], dtype=jnp.float32) -> np.ndarray:
  """[V] logits after `ids` (one forward, padded to a power of two: few compiles)."""
  tokens = np.zeros((1, bucket(len(ids))), np.int32)
  tokens[0, : len(ids)] = ids
  logits = _last_logits_fn(model.config, dtype)(model.params, jnp.asarray(tokens), jnp.int32(len(ids)))
  return np.asarray(logits)


class LocalJudge:
  """Judges with a loaded model (`load.LoadedModel`); prompts over `max_prompt_tokens` get their answers cut."""

  def __init__(self, model, max_prompt_tokens: int = 4096, chat: bool = True, dtype=jnp.float32):
    if model.tokenizer is None:
      raise LocalJudgeError(f"a local judge needs a model with a tokenizer; {model.source} has none")
    if max_prompt_tokens < 64:
      raise LocalJudgeError(f"max_prompt_tokens must be at least 64, got {max_prompt_tokens}")
    self.model, self.max_prompt_tokens, self.chat, self.dtype = model, max_prompt_tokens, chat, dtype
    self.a_id, self.b_id = letter_ids(model.tokenizer)
    self.name = f"local:{model.source}:{prompt.PROMPT_VERSION}"

  def __repr__(self) -> str:
    return f"LocalJudge({self.name!r})"

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    logits = self.next_token_logits(self.prompt_ids(instruction, first, second))
    return Verdict(p_first(logits, self.a_id, self.b_id))

  def prompt_ids(self, instruction: str, first: str, second: str) -> list[int]:
    """The prompt's ids; over budget, both answers lose their tails (alike, so neither is favoured)
    and, as a last resort, the middle of the prompt goes (its end, which asks for the letter, stays)."""
    encode = lambda a, b: prompt_ids(self.model.tokenizer, [prompt.local_prompt(instruction, a, b)], self.chat)[0]
    ids = encode(first, second)
    if len(ids) <= self.max_prompt_tokens:
      return ids
    overhead = len(encode(TRUNCATED, TRUNCATED))  # everything but the answers
    for _ in range(4):
      room, used = self.max_prompt_tokens - overhead, len(ids) - overhead
      if room <= 0 or len(ids) <= self.max_prompt_tokens:
        break
      keep = 0.95 * room / max(used, 1)
      first, second = _cut(first, keep), _cut(second, keep)
      ids = encode(first, second)
    if len(ids) > self.max_prompt_tokens:
      half = self.max_prompt_tokens // 2
      ids = ids[:half] + ids[len(ids) - (self.max_prompt_tokens - half):]
    return ids

  def next_token_logits(self, ids: list[int]) -> np.ndarray:
    return next_token_logits(self.model, ids, self.dtype)


def _cut(text: str, keep: float) -> str:
  if text.endswith(TRUNCATED):
    text = text[: -len(TRUNCATED)]
  return text[: max(0, int(len(text) * keep))] + TRUNCATED
