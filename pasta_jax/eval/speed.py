"""Speed metrics of one method against its reference, per prompt and aggregated (paper section 5.1).

Per prompt:
  realized speedup     = reference seconds / method seconds (each the second of two runs)
  theoretical speedup  = reference content tokens / method critical path
  parallelism          = method content tokens / method critical path
Aggregates: the geometric mean (the paper's, right for ratios) and the arithmetic mean (the common
practice it reports in its appendix E), over the prompts where the ratio is defined (finite, > 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from pasta_jax.eval.methods import MethodOutput
from pasta_jax.lang.metrics import arithmetic_mean, geometric_mean

SPEED_METRICS = ("realized_speedup", "theoretical_speedup", "parallelism")


@dataclasses.dataclass(frozen=True)
class PromptSpeed:
  realized_speedup: float
  theoretical_speedup: float
  parallelism: float


@dataclasses.dataclass(frozen=True)
class Aggregate:
  geometric: float
  arithmetic: float
  n: int  # prompts with a defined value


def prompt_speed(method: MethodOutput, reference: MethodOutput) -> PromptSpeed:
  return PromptSpeed(realized_speedup=ratio(reference.seconds, method.seconds),
                     theoretical_speedup=ratio(reference.content_tokens, method.critical_path),
                     parallelism=ratio(method.content_tokens, method.critical_path))


def ratio(numerator: float, denominator: float) -> float:
  if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
    return math.nan
  return numerator / denominator


def aggregate(values: Iterable[float]) -> Aggregate:
  defined = [v for v in values if math.isfinite(v) and v > 0]
  return Aggregate(geometric_mean(defined), arithmetic_mean(defined), len(defined))


def aggregate_speeds(speeds: Iterable[PromptSpeed]) -> dict[str, Aggregate]:
  speeds = list(speeds)
  return {name: aggregate(getattr(s, name) for s in speeds) for name in SPEED_METRICS}
