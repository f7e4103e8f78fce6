"""The paper's published quality/speed points (PASTA, section 5.2), drawn as reference in `pareto.png`.

Gemma 7B on H100, greedy, batch 1, 805 AlpacaEval prompts; quality is the LC win rate against the
sequential Baseline-SFT judged by GPT-4; speedup the geometric mean of realized speedups. Only the
numbers the text states are here: Pasta-BoN-4 and -8 and the theoretical speedups appear in the
figures alone, and SoT on Baseline-SFT is said to give no speedup with no win rate given.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PublishedPoint:
  label: str
  realized_speedup: float  # geometric mean over the 805 prompts
  lc_win_rate: float  # percent, against Baseline-SFT
  source: str


PAPER_POINTS = (
  PublishedPoint("Baseline-SFT", 1.0, 50.0, "5.2: the baseline, marked X (50% against itself, no speedup)"),
  PublishedPoint("Pasta-BoN-∞", 1.21, 52.3, "5.2: best quality, 52.3% at 1.21x"),
  PublishedPoint("Pasta-BoN-2", 1.62, 45.5, "5.2: 1.62x, 4.3 points above APAR's 41.2%"),
  PublishedPoint("Pasta-BoN-1", 1.93, 42.9, "5.2: best speedup, 42.9% at 1.93x"),
  PublishedPoint("APAR", 1.60, 41.2, "5.2: 1.6x, 41.2%"),
  PublishedPoint("SoT (Gemma-IT)", 1.61, 38.0, "5.2: 1.61x 'while dropping its win rate by 12%', drawn as 50 - 12"),
)
