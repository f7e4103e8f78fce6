"""The model-verified filter (the earlier PASTA paper's approximate-independence test).

An annotation claims its blocks can be written without each other. The local model checks the claim:
one forward over the answer laid out with the PASTA mask (each block sees main up to its promise,
main sees blocks only after a sync) and one causal forward over the tag-free answer (full context).
For every content token that predicts a content token, compare the two greedy predictions. Keep the
annotation only if few change (default: under 20%) and its theoretical speedup is large enough
(default: at least 1.2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.data.encode import end_id, prompt_token_ids
from pasta_jax.decode.api import LangTokenizer
from pasta_jax.errors import TagError
from pasta_jax.lang import metrics, text
from pasta_jax.lang.layout import layout_example, plain_layout
from pasta_jax.lang.tokens import encode_answer, strip_token_ids
from pasta_jax.model.gemma import Gemma


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
  max_changed: float = 0.20  # share of changed next-token predictions allowed
  min_speedup: float = 1.2
  chat: bool = True


@dataclasses.dataclass(frozen=True)
class Verdict:
  keep: bool
  changed: float  # share of content predictions that change without the blocks' context
  speedup: float  # theoretical speedup of the annotation
  reason: str


@functools.lru_cache(maxsize=4)
def _argmax_fn(config):
  apply = Gemma(config).apply  # full forwards of model.params: the training layout

  @jax.jit
  def run(params, tokens, positions, mask):
    logits = apply(params, tokens[None], positions[None], mask[None]).logits
    return jnp.argmax(logits[0], axis=-1)

  return run


def _predictions(model, layout) -> np.ndarray:
  return np.asarray(_argmax_fn(model.config)(model.params, jnp.asarray(layout.tokens),
                                             jnp.asarray(layout.positions), layout.mask()))


def content_rows(layout, vocab, num_prompt: int) -> list[int]:
  """Rows holding the answer's content tokens, in layout order (= the tag-free answer's order, since
  blocks are laid out right after their promises): no prompt, tags, promise topics or end id."""
  rows, in_topic = [], False
  for i in range(num_prompt, int(layout.valid.sum())):
    token = int(layout.tokens[i])
    if layout.thread[i] == 0:
      in_topic = (in_topic or token == vocab.promise) and not vocab.is_length(token)
    if not in_topic and token not in vocab.tag_ids and token not in vocab.eos_ids:
      rows.append(i)
  return rows


def verify(record: Mapping[str, str], model, config: VerifyConfig = VerifyConfig()) -> Verdict:
  """Checks one record's `annotated` answer (promise form) with `model`."""
  tokenizer, vocab = model.tokenizer, model.tokenizer.tag_vocab()
  misses = text.near_misses(record["annotated"])
  if misses:  # they would train as plain words: the annotation does not say what it means to
    return Verdict(False, math.nan, math.nan, f"near-miss tags are plain text here: {', '.join(misses[:3])}")
  prompt = prompt_token_ids(tokenizer, record["instruction"], config.chat)
  ids = encode_answer(record["annotated"], LangTokenizer(tokenizer), vocab)
  end = end_id(tokenizer, vocab, config.chat)
  speedup = metrics.theoretical_speedup(ids, vocab)
  pasta = layout_example(prompt, ids, vocab, eos_id=end)
  plain = plain_layout(prompt, strip_token_ids(ids, vocab), end)
  pasta_rows, plain_rows = content_rows(pasta, vocab, len(prompt)), content_rows(plain, vocab, len(prompt))
  if [int(pasta.tokens[i]) for i in pasta_rows] != [int(plain.tokens[i]) for i in plain_rows]:
    raise TagError(f"record {record.get('id', '?')!r}: its annotation's content is not its tag-free answer "
                   "token for token (a tag splits a word?), so predictions cannot be compared")
  # Compare where both predict the same next content token (a block's last token predicts </async>
  # in the PASTA stream and is skipped).
  pairs = [(a, b) for a, b in zip(pasta_rows, plain_rows, strict=True)
           if int(pasta.targets[a]) == int(plain.targets[b]) and int(plain.targets[b]) not in vocab.eos_ids]
  p_pasta, p_plain = _predictions(model, pasta), _predictions(model, plain)
  changed = float(np.mean([p_pasta[a] != p_plain[b] for a, b in pairs])) if pairs else 0.0
  if changed >= config.max_changed:
    return Verdict(False, changed, speedup, f"{changed:.0%} of predictions change without the blocks' context")
  if speedup < config.min_speedup:
    return Verdict(False, changed, speedup, f"theoretical speedup {speedup:.2f} < {config.min_speedup}")
  return Verdict(True, changed, speedup, "")
