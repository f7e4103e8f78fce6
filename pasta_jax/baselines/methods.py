"""Skeleton-of-Thought's two stages as `pasta eval` methods (BASELINE_METHODS; commands/eval_registry.py lists them):

  sot           Skeleton-of-Thought: outline on one lane, then every point in its own lane
  sot-router    SoT where the model's yes/no router decides per prompt (rules if the tokenizer lacks
                single yes/no tokens)
  sot-forced    SoT whose outline is replayed from the reference answer's list items (for models that
                cannot write one, like the 270M base model); the points are still expanded freely

The registry's `Sot` method is the point fan-out alone (it runs on given point prompts); these run both stages.
APAR, like every method that decodes freely, is an eval method through the registry (eval/methods.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pasta_jax.baselines import sot
from pasta_jax.data.encode import record_prompt
from pasta_jax.errors import PastaError
from pasta_jax.eval import methods as M
from pasta_jax.methods import Sot


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


def _sot(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=False)


def _sot_router(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=True)


def _sot_forced(spec, model, settings):
  return SotMethod(spec.label, model, settings, use_router=False, forced=True)


BASELINE_METHODS: dict[str, M.MethodFactory] = {
  Sot.name: _sot, f"{Sot.name}-router": _sot_router, Sot.name + M.FORCED: _sot_forced,
}
