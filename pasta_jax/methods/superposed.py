"""Superposed Decoding: k drafts from one decode, each step feeding the drafts' superposed embeddings (paper 002)."""

from __future__ import annotations

import dataclasses
import functools

from pasta_jax.decode.ngram import NgramIndex
from pasta_jax.decode.result import drafts_result
from pasta_jax.decode.rules import SuperposedRules
from pasta_jax.errors import PastaError
from pasta_jax.methods.base import Capabilities, Layout, Method, Setup, option_help

DEFAULT = "default"  # the training pools' index (`pasta ngram build`), built on first use


def parse_ngram(text: str) -> str | None:
  return None if text == "none" else text


@dataclasses.dataclass(frozen=True)
class Superposed(Method):
  name = "superposed"
  summary = "Superposed Decoding: k drafts from one decode, n-gram smoothed (the best draft is the answer)"
  capabilities = Capabilities(sample=False, shard=True, certify_head=False, drafts=True)

  drafts: int = dataclasses.field(default=3, metadata=option_help("how many drafts (k)"))
  ngram: str | NgramIndex | None = dataclasses.field(
      default=DEFAULT, metadata=option_help("the n-gram index folder (`pasta ngram build`), 'default' (the training "
                                            "pools', built on first use) or 'none' (no smoothing); in Python also "
                                            "an `NgramIndex`",
                                            parse=parse_ngram))

  def check_options(self) -> None:
    if self.drafts < 1:
      raise ValueError(f"drafts must be at least 1, got {self.drafts}")

  @property
  def max_choices(self) -> int:
    return self.drafts

  def setup(self, model, setup: Setup) -> Superposed:
    """The default index is built once from the training pools (~5 s) when it is missing."""
    if self.ngram != DEFAULT:
      return self
    from pasta_jax.data.ngram_corpus import ensure_default_index
    return dataclasses.replace(self, ngram=str(ensure_default_index(model.tokenizer, model.describe())))

  def layout(self, model, scripts) -> Layout:
    index = self.ngram if self.ngram is None or isinstance(self.ngram, NgramIndex) else load_index(self.ngram)
    weight = 0.0 if index is None else SuperposedRules.ngram_weight
    return Layout(SuperposedRules(drafts=self.drafts, ngram_weight=weight), lanes=1, max_threads=1,
                  rule_inputs=None if index is None else index.device_arrays())

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return drafts_result(run, seconds, tokenizer, vocab, method)


@functools.lru_cache(maxsize=2)
def load_index(folder: str) -> NgramIndex:
  try:
    return NgramIndex.load(folder)
  except (FileNotFoundError, ValueError) as err:
    raise PastaError(str(err)) from None
