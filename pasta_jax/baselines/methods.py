"""The paper's baselines as `pasta eval` methods (BASELINE_METHODS; commands/eval_registry.py lists them):

  apar          the model decodes freely in APAR mode (an APAR-trained model forks at its fork tokens)
  apar-forced   replays the APAR-format annotation (data/apar_format.py) of the record's reference
                answer cut to --max-new-tokens; measured against its tag-free twin, sequential-forced
  sot           Skeleton-of-Thought: outline on one lane, then every point in its own lane
  sot-router    SoT where the model's yes/no router decides per prompt (rules if the tokenizer lacks
                single yes/no tokens)
  sot-forced    SoT whose outline is replayed from the reference answer's list items (for models that
                cannot write one, like the 270M base model); the points are still expanded freely
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from pasta_jax.baselines import sot
from pasta_jax.data.apar_format import apar_annotate
from pasta_jax.data.encode import record_prompt
from pasta_jax.decode import api
from pasta_jax.errors import PastaError, TagError
from pasta_jax.eval import methods as M


def tree_output(result: api.Result, note: str = "") -> M.MethodOutput:
  if result.fork_refusals:  # what the limits suppressed is reported with the answer
    note = "; ".join(filter(None, [note, f"{result.fork_refusals} forks refused (depth limit or no free lane)"]))
  return M.MethodOutput(text=result.text, annotated=result.annotated, steps=result.steps, seconds=result.seconds,
                        theoretical_speedup=result.theoretical_speedup, parallelism=result.theoretical_speedup,
                        content_tokens=result.content_tokens, critical_path=float(result.critical_path or math.nan),
                        finished=result.finished, threads=len(result.thread_texts), note=note)


class AparMethod:
  """APAR decoding, free or replaying the APAR-format annotation of the reference answer."""

  def __init__(self, name: str, model, settings: M.DecodeSettings, forced: M.ForcedAnswer | None = None,
               reference=None):
    self.name, self.model, self.settings, self.forced, self.reference = name, model, settings, forced, reference

  def check(self, records: Sequence[Mapping[str, str]]) -> None:
    if self.forced is not None:
      self.forced.check(records, self.name)

  def answer(self, record: Mapping[str, str]) -> tuple[str | None, str, int]:
    if self.forced is None:
      return None, "", self.settings.max_new_tokens
    plain = self.forced.truncated(M.reference_answer(record))
    _, _, budget = self.forced(record)  # the twin's budget: equal pools and step budgets
    result = apar_annotate(plain)
    if result.annotated is None:
      return plain, f"APAR: {result.reason}: replayed without forks", budget
    return result.annotated, "", budget

  def run(self, record: Mapping[str, str]) -> M.MethodOutput:
    s = self.settings
    answer, note, budget = self.answer(record)
    try:
      [result] = api.generate(self.model, [record_prompt(record)], method="apar", max_new_tokens=budget,
                              lanes=s.lanes, chat=s.chat, dtype=jnp.dtype(s.dtype),
                              forced_answers=None if answer is None else [answer])
    except TagError as err:
      raise M.MethodError(f"prompt {record['id']}: its APAR answer cannot be replayed: {err}") from None
    return tree_output(result, note)


class SotMethod:
  def __init__(self, name: str, model, settings: M.DecodeSettings, use_router: bool, forced: bool = False):
    self.name, self.reference, self.forced = name, None, forced
    router, self.note = None, ""
    if use_router:
      try:
        router = sot.ModelRouter(model, chat=settings.chat)
      except PastaError as err:
        router, self.note = sot.RuleRouter(), f"rule router ({err})"
    config = sot.SotConfig(answer_tokens=settings.max_new_tokens, chat=settings.chat, dtype=settings.dtype,
                           max_points=min(8, max(2, settings.lanes)))
    self.runner = sot.SkeletonOfThought(model, config, router)

  def check(self, records: Sequence[Mapping[str, str]]) -> None:
    pass

  def run(self, record: Mapping[str, str]) -> M.MethodOutput:
    skeleton = None
    if self.forced:
      skeleton = sot.skeleton_from_answer(M.reference_answer(record), self.runner.config.max_points) or ""
    r = self.runner.run(record_prompt(record), forced_skeleton=skeleton)
    path = float(r.steps)
    note = "; ".join(x for x in (self.note, r.note, f"SoT with {len(r.points)} points" if r.used_sot else "") if x)
    return M.MethodOutput(text=r.text, annotated=r.text, steps=r.steps, seconds=r.seconds,
                          theoretical_speedup=sot.theoretical_speedup(r), parallelism=sot.theoretical_speedup(r),
                          content_tokens=r.content_tokens, critical_path=path, finished=r.finished,
                          threads=max(1, len(r.points)), note=note)


def _apar(spec, model, settings):
  return AparMethod(spec.label, model, settings)


def _apar_forced(spec, model, settings):
  twin = M.CORE_METHODS["sequential-forced"](M.MethodSpec("sequential-forced", spec.model_path), model, settings)
  return AparMethod(spec.label, model, settings, M.ForcedAnswer(model, settings.max_new_tokens, tagged=False),
                    reference=twin)


def _sot(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=False)


def _sot_router(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=True)


def _sot_forced(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=False, forced=True)


BASELINE_METHODS: dict[str, M.MethodFactory] = {
  "apar": _apar, "apar-forced": _apar_forced, "sot": _sot, "sot-router": _sot_router, "sot-forced": _sot_forced,
}
