"""PASTA: the model's promises fork threads that decode in parallel over one interleaved KV pool (paper 001)."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode import api
from pasta_jax.decode.rules import PastaRules
from pasta_jax.lang import schema
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.lang.text import strip_tags
from pasta_jax.methods.base import Capabilities, Layout, Threaded, option_help
from pasta_jax.methods.sequential import Sequential


@dataclasses.dataclass(frozen=True)
class Pasta(Threaded):
  name = "pasta"
  summary = "PASTA: the model's promises fork threads that decode in parallel (streams; thread chart)"
  capabilities = Capabilities(stream=True, replay=True, shard=True, promises=True, distinct_topics=True,
                              threads=True, annotates=True)
  annotation_field = "annotated"

  position_mode: str = dataclasses.field(
      default="pred", metadata=option_help("block positions: " + ", ".join(schema.POSITION_MODES),
                                           cli=False))

  def check_options(self) -> None:
    super().check_options()
    schema.length_step(self.position_mode)  # raises for an unknown mode

  def layout(self, model, scripts) -> Layout:
    return Layout(PastaRules(), self.lanes, self.max_threads)

  def annotate_reference(self, answer: str, count_tokens) -> tuple[str | None, str]:
    from pasta_jax.data.structural import annotate
    annotated = annotate(answer, count_tokens)
    return (annotated, "") if annotated is not None else (None, "no list structure")

  def tag_free(self, annotated: str) -> str:
    return strip_tags(annotated)

  def tag_free_twin(self) -> Sequential:
    return Sequential()

  def scripts(self, answers, model) -> list:
    lang, vocab = api.LangTokenizer(model.tokenizer), tag_vocab_for(model.tokenizer, self.position_mode)
    return [api.forced_scripts(a, lang, vocab, f"forced answer {i}: ", self.position_mode)
            for i, a in enumerate(answers)]
