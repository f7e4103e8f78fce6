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
