"""Plain decoding on one lane: the baseline every speedup is measured against."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode import api
from pasta_jax.decode.rules import SequentialRules
from pasta_jax.errors import PastaError
from pasta_jax.methods.base import Capabilities, Layout, Method, option_help


@dataclasses.dataclass(frozen=True)
class Sequential(Method):
  name = "sequential"
  summary = "plain decoding on one lane: the baseline (streams)"
  capabilities = Capabilities(stream=True, replay=True, shard=True, annotates=True)

  ignore_eos: bool = dataclasses.field(
      default=False, metadata=option_help("decode past the end id (fixed-length timing runs)", cli=False))

  def layout(self, model, scripts) -> Layout:
    if scripts is not None and any(len(s) > 1 for s in scripts):
      raise PastaError("method='sequential' replays tag-free answers; this one has blocks (use method='pasta')")
    return Layout(SequentialRules(ignore_eos=self.ignore_eos), lanes=1, max_threads=1)

  def annotate_reference(self, answer: str, count_tokens) -> tuple[str | None, str]:
    return answer, ""  # its form is the tag-free answer

  def scripts(self, answers, model) -> list:
    lang, vocab = api.LangTokenizer(model.tokenizer), model.tokenizer.tag_vocab()
    return [api.forced_scripts(a, lang, vocab, f"forced answer {i}: ") for i, a in enumerate(answers)]
