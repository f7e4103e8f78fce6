"""The pairwise judge interface shared by preference scoring (training) and `pasta eval` (quality).

A judge reads one instruction and two answers and says which is better, with a confidence:
`Verdict.p_first` is the probability that the first answer shown is the better one. Judges are
position-biased, so callers use `judge_both_orders`, which shows the pair both ways and averages.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One judgement of (instruction, first, second)."""

  p_first: float  # P(first answer is better), in [0, 1]; 0.5 = tie / no preference
  raw: str = ""  # the judge's raw reply (for audit), never secrets

  @property
  def winner(self) -> str:
    return "first" if self.p_first > 0.5 else "second" if self.p_first < 0.5 else "tie"


@runtime_checkable
class Judge(Protocol):
  name: str  # identifies the judge (model, prompt version) in caches and reports

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    """Judges one ordered pair."""
    ...


def judge_both_orders(judge: Judge, instruction: str, answer: str, opponent: str) -> float:
  """P(answer beats opponent), averaged over both presentation orders (cancels position bias)."""
  forward = judge.compare(instruction, answer, opponent).p_first
  backward = judge.compare(instruction, opponent, answer).p_first
  return 0.5 * (forward + (1.0 - backward))
