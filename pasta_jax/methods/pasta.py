"""PASTA: the model's promises fork threads that decode in parallel over one interleaved KV pool (paper 001)."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode import api
from pasta_jax.decode.rules import PastaRules
from pasta_jax.errors import PastaError
from pasta_jax.lang import schema
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.lang.text import strip_tags
from pasta_jax.methods.base import Capabilities, Layout, Threaded, option_help
from pasta_jax.methods.sequential import Sequential
from pasta_jax.model.load import GENERATION_FILE, generation_defaults


@dataclasses.dataclass(frozen=True)
class Pasta(Threaded):
  name = "pasta"
  summary = "PASTA: the model's promises fork threads that decode in parallel (streams; thread chart)"
  capabilities = Capabilities(stream=True, replay=True, shard=True, promises=True, distinct_topics=True,
                              topic_cap=True, threads=True, annotates=True)
  annotation_field = "annotated"

  # None: the mode the model was trained in (its generation.json's `position_mode`, else pred): a model writes the
  # LENGTH tokens of its own mode, and read in another one its blocks are placed at the wrong distances
  position_mode: str | None = dataclasses.field(
      default=None, metadata=option_help("block positions: " + ", ".join(schema.POSITION_MODES) + " (default: the "
                                         "model's)", cli=False))

  def check_options(self) -> None:
    super().check_options()
    if self.position_mode is not None:
      schema.length_step(self.position_mode)  # raises for an unknown mode

  def setup(self, model, setup) -> Pasta:
    return self if self.position_mode is not None else dataclasses.replace(self, position_mode=self.mode_for(model))

  def mode_for(self, model) -> str:
    """The position mode this method decodes `model` in: its own, else the one the model was trained in."""
    return self.position_mode or trained_position_mode(model)

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
    mode = self.mode_for(model)  # (an unprepared method too: the eval's forced answers)
    lang, vocab = api.LangTokenizer(model.tokenizer), tag_vocab_for(model.tokenizer, mode)
    return [api.forced_scripts(a, lang, vocab, f"forced answer {i}: ", mode) for i, a in enumerate(answers)]


def trained_position_mode(model) -> str:
  """The position mode `model` was trained in: its generation.json's `position_mode` (the trainer writes it for
  a PASTA model), else pred (also for a model built in memory, with no folder)."""
  if getattr(model, "source", None) is None:
    return "pred"
  mode = generation_defaults(model).get("position_mode", "pred")
  if mode not in schema.POSITION_MODES:
    raise PastaError(f"{model.source}/{GENERATION_FILE}: unknown position_mode {mode!r}; use one of "
                     f"{', '.join(schema.POSITION_MODES)}")
  return mode
