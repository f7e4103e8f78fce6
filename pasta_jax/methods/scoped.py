"""The earlier PASTA paper's scoped form (paper 000): `<scope>` and attribute-less `<promise/>` tags, nested forks,
a sync at `</scope>`, each promise replaced by its content."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode import api
from pasta_jax.decode.result import scoped_result
from pasta_jax.decode.rules import ScopedRules
from pasta_jax.lang import scoped
from pasta_jax.methods.apar import MAX_DEPTH
from pasta_jax.methods.base import Capabilities, Layout, Threaded


@dataclasses.dataclass(frozen=True)
class Scoped(Threaded):
  name = "pasta-v0"
  summary = "the earlier PASTA's scoped tags: <scope> and <promise/> fork nested threads (thread chart)"
  capabilities = Capabilities(replay=True, shard=True, promises=True, threads=True, annotates=True)
  annotation_field = "scoped"

  max_depth: int = dataclasses.field(default=3, metadata=MAX_DEPTH)  # of scopes and of fork nesting

  def layout(self, model, scripts) -> Layout:
    return Layout(ScopedRules(max_depth=self.max_depth), self.lanes, self.max_threads)

  def annotate_reference(self, answer: str, count_tokens) -> tuple[str | None, str]:
    """The earlier paper's rule: lists are scopes, item elaborations async blocks (`data.structural_scoped`)."""
    from pasta_jax.data.structural_scoped import annotate_scoped
    annotated = annotate_scoped(answer, count_tokens)
    return (annotated, "") if annotated is not None else (None, "no list structure")

  def tag_free(self, annotated: str) -> str:
    return scoped.compose_text(annotated)

  def tag_free_twin(self) -> Scoped:
    return self  # the tag-free answer through the same scoped interpreter

  def scripts(self, answers, model) -> list:
    lang, vocab = api.LangTokenizer(model.tokenizer), model.tokenizer.tag_vocab()
    return [api.scoped_scripts(a, lang, vocab, self.lanes, self.max_threads, self.max_depth, f"forced answer {i}: ")
            for i, a in enumerate(answers)]

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return scoped_result(run, seconds, tokenizer, vocab, method)
