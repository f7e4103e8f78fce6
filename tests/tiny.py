"""Tiny random models with a character-level tokenizer, shared by the fast tests (no weights, no hub)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.config import get_config
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import LoadedModel

BOS, EOS = 2, 1
TEXT_BASE = 100  # character c -> TEXT_BASE + ord(c) (ASCII only), above the tag ids 10..65


class CharTokenizer:
  """Tokenizer-like: one id per ASCII character, tags on ids 10.., explicit BOS."""

  hf = None
  eos_ids = (EOS,)

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    return ([BOS] if add_bos else []) + [TEXT_BASE + ord(c) for c in text]

  def decode(self, ids) -> str:
    return "".join(chr(i - TEXT_BASE) for i in ids if i >= TEXT_BASE)

  def chat_prompt(self, text: str) -> str:
    return f"<u>{text}<m>"

  def tag_vocab(self, length_step: int = 10) -> TagVocab:
    return TagVocab.from_base(10, self.eos_ids, length_step)


@functools.cache  # built once per process: most test modules take the same one, and each init costs seconds
def tiny_model(name: str = "tiny-gemma3", seed: int = 0, **overrides) -> LoadedModel:
  """A random tiny model; `overrides` replace config fields (num_heads=8 for an 8-way tensor split). Shared by
  every caller in the process: treat it as read-only."""
  config = dataclasses.replace(get_config(name), **overrides)
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = Gemma(config).init(jax.random.key(seed), tokens, tokens, jnp.ones((1, 4, 4), bool))
  label = "".join(f",{k}={v}" for k, v in overrides.items())
  return LoadedModel(config, params, CharTokenizer(), f"random:{name}:{seed}{label}")


BYTE_BASE = 300  # in BytePieces, id BYTE_BASE + b is the byte b (a byte-fallback piece)


class BytePieces(CharTokenizer):
  """CharTokenizer plus byte pieces, decoded as Hugging Face's ByteFallback decodes them: consecutive bytes as one
  UTF-8 string, or one replacement mark per byte where they are not valid UTF-8. So ids decoded together can read
  differently from the same ids decoded apart, and a later id can change how earlier ones read."""

  def decode(self, ids) -> str:
    out, pending = [], bytearray()
    for i in [*ids, None]:
      if i is not None and BYTE_BASE <= i < BYTE_BASE + 256:
        pending.append(i - BYTE_BASE)
        continue
      if pending:
        try:
          out.append(pending.decode("utf-8"))
        except UnicodeDecodeError:
          out.append("\ufffd" * len(pending))
        pending = bytearray()
      if i is not None:
        out.append(super().decode([i]))
    return "".join(out)


def biased_model_fn(model_fn, bias):
  """`api.model_fn` with `bias[input token]` added to the model's logits (scaled down), cached as model_fn is: a
  tiny random model that writes what the bias favours after each token (tags, in the streaming tests)."""

  @functools.cache
  def bent(config, dtype, attention="xla", head_dtype=None):
    apply = model_fn(config, dtype, attention, head_dtype)

    def call(params, tokens, *args, **kwargs):
      out = apply(params, tokens, *args, **kwargs)
      if out.logits is None:
        return out
      rows = kwargs.get("logit_rows")  # the prefill's: each prompt's last token
      inputs = tokens if rows is None else jnp.take_along_axis(tokens, rows, axis=1)
      return dataclasses.replace(out, logits=0.02 * out.logits + bias[inputs])
    return call
  return bent
