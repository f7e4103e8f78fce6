"""Skeleton-of-Thought's point fan-out: after the shared prefix, every point of a skeleton decodes in its own lane
(paper 005). Its runs take the point prompts as per-thread scripts; the skeleton stage that writes them is
`pasta_jax.baselines.sot.SkeletonOfThought` (and, served, `serve/sot.py`)."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode.result import tree_result
from pasta_jax.decode.rules import SotRules
from pasta_jax.errors import PastaError
from pasta_jax.methods.apar import apar_form_scripts
from pasta_jax.methods.base import Capabilities, Layout, Threaded


@dataclasses.dataclass(frozen=True)
class Sot(Threaded):
  name = "sot"
  summary = "Skeleton-of-Thought: an outline, then every point expanded in its own lane (served in two stages)"
  capabilities = Capabilities(replay=True, shard=True, needs_scripts=True)


  def layout(self, model, scripts) -> Layout:
    if not scripts or len({len(s) for s in scripts}) != 1:
      raise PastaError("method='sot' expands points: give each prompt the same number of point prompts as `scripts` "
                       "(pasta_jax.baselines.sot builds them from a skeleton)")
    return Layout(SotRules(initial_threads=len(scripts[0])), self.lanes, self.max_threads)

  def scripts(self, answers, model) -> list:
    return apar_form_scripts(answers, model, self.lanes, self.max_threads)

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return tree_result(run, seconds, tokenizer, vocab, method)
