"""APAR: the model's fork tokens spawn children that decode beside their parent, released as they end (paper 003)."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode import api
from pasta_jax.decode.result import tree_result
from pasta_jax.decode.rules import AparRules
from pasta_jax.methods.base import Capabilities, Layout, Threaded, option_help
from pasta_jax.methods.sequential import Sequential

MAX_DEPTH = option_help("the fork depth limit (main = 0)", cli=False)


@dataclasses.dataclass(frozen=True)
class Apar(Threaded):
  name = "apar"
  summary = "APAR: fork tokens spawn children that decode beside their parent (an APAR-trained model)"
  capabilities = Capabilities(replay=True, shard=True, annotates=True)

  max_depth: int = dataclasses.field(default=3, metadata=MAX_DEPTH)

  def layout(self, model, scripts) -> Layout:
    return Layout(AparRules(max_depth=self.max_depth), self.lanes, self.max_threads)

  def annotate_reference(self, answer: str, count_tokens) -> tuple[str | None, str]:
    from pasta_jax.data.apar_format import apar_annotate
    result = apar_annotate(answer)
    return (result.annotated, "") if result.annotated is not None else (None, f"APAR: {result.reason}")

  def tag_free_twin(self) -> Sequential:
    return Sequential()

  def scripts(self, answers, model) -> list:
    return apar_form_scripts(answers, model, self.lanes, self.max_threads)

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return tree_result(run, seconds, tokenizer, vocab, method)


def apar_form_scripts(answers, model, lanes: int, max_threads: int) -> list:
  """Answers in APAR's text form -> per-thread scripts (main first, children in spawn order)."""
  lang, vocab = api.LangTokenizer(model.tokenizer), model.tokenizer.tag_vocab()
  return [api.apar_scripts(a, lang, vocab, lanes, max_threads, f"forced answer {i}: ") for i, a in enumerate(answers)]
