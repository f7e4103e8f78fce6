"""Scoring sampled answers (the later paper, section 4).

  speedup  = baseline tokens / critical path: the Baseline-SFT greedy answer's token count over the
             decode steps the sample needs with unlimited lanes (`lang.metrics.critical_path`).
  quality  = confidence-weighted wins / confidence-weighted losses over pairwise judgements against
             the baseline answer and the dataset's reference answer, each shown in both orders.
             A judgement prefers one answer with confidence c = max(p, 1 - p) (p = P(first is better));
             it adds c to wins or losses. An exact tie (p = 0.5) adds 0.5 to both. Losses are floored
             (`loss_floor`) so an answer that beats everything scores finite.
             With quality_measure "rouge" instead: the sample's ROUGE-L against the reference answer
             over the baseline answer's (`rouge_quality`). With "logp": the ratio of the sample's and the
             baseline answer's geometric-mean token probabilities under the baseline model (`likelihood_quality`).
  score    = speedup + lambda * quality - penalty * duplicate share; lambda = inf ranks by quality alone
             (speedup, less the penalty, breaks ties). The duplicate share is the share of the sample's
             sibling-block pairs that repeat each other (`lang.metrics.duplicate_block_pairs`).
The pair is the best- and worst-scoring well-formed samples; a prompt whose samples all score the
same yields no pair (it would teach nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from pasta_jax.judges.base import Judge
from pasta_jax.lang.metrics import duplicate_block_pairs, rouge_l


@dataclasses.dataclass(frozen=True)
class Judgement:
  opponent: str  # "baseline" | "reference"
  answer_first: bool  # the order the judge saw
  p_answer: float  # P(the sample is better), from the judge's P(first is better)


def judge_against(judge: Judge, prompt: str, answer: str, opponents: dict[str, str]) -> list[Judgement]:
  """Both orders against each opponent (4 judgements for a baseline and a reference)."""
  out = []
  for name, other in opponents.items():
    out.append(Judgement(name, True, judge.compare(prompt, answer, other).p_first))
    out.append(Judgement(name, False, 1.0 - judge.compare(prompt, other, answer).p_first))
  return out


def wins_and_losses(judgements: Sequence[Judgement]) -> tuple[float, float]:
  wins = losses = 0.0
  for j in judgements:
    if j.p_answer > 0.5:
      wins += j.p_answer
    elif j.p_answer < 0.5:
      losses += 1.0 - j.p_answer
    else:
      wins, losses = wins + 0.5, losses + 0.5
  return wins, losses


def quality(judgements: Sequence[Judgement], loss_floor: float) -> float:
  wins, losses = wins_and_losses(judgements)
  return wins / max(losses, loss_floor)


ROUGE_FLOOR = 0.05  # a baseline answer with (almost) no overlap with the reference does not blow the ratio up


def rouge_quality(sample: str, baseline: str, reference: str) -> float:
  """ROUGE-L(sample, reference) / ROUGE-L(baseline, reference), the denominator floored at ROUGE_FLOOR."""
  return rouge_l(sample, reference) / max(rouge_l(baseline, reference), ROUGE_FLOOR)


def likelihood_quality(sample_logp: float, baseline_logp: float) -> float:
  """exp(sample's mean log p per token - the baseline answer's), both under one scoring model: the ratio of
  their geometric-mean token probabilities (1 = as likely as the baseline's own answer)."""
  return math.exp(sample_logp - baseline_logp)


def score(speedup: float, quality_value: float, quality_weight: float, duplicate_cost: float = 0.0
          ) -> tuple[float, float]:
  """A sort key: (score, tie-break). lambda = inf: (quality, speedup - duplicate cost)."""
  if math.isinf(quality_weight):
    return quality_value, speedup - duplicate_cost
  return speedup + quality_weight * quality_value - duplicate_cost, 0.0


def duplicate_share(blocks: Sequence[str]) -> float:
  """Share of sibling-block pairs that repeat each other (0 with fewer than two blocks)."""
  dupes, pairs = duplicate_block_pairs(blocks)
  return dupes / pairs if pairs else 0.0


def best_and_worst(keys: Sequence[tuple[float, float]]) -> tuple[int, int] | None:
  """Indices of the highest and lowest keys (first wins ties); None when every key is equal."""
  if len(keys) < 2:
    return None
  best = max(range(len(keys)), key=lambda i: keys[i])
  worst = min(range(len(keys)), key=lambda i: keys[i])
  return None if keys[best] == keys[worst] else (best, worst)
