"""Skeleton-of-Thought's point expansion (Ning et al. 2024) as rules: APAR's transitions with a fan-out.

Threads 0..k-1 start together after the shared prompt, each forced through its own point prompt (a
script prefix), then each samples its expansion; nobody forks (depth limit 0) and nobody syncs.
The skeleton stage and the prompts are the baseline's (`pasta_jax/baselines/sot.py`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pasta_jax.decode.rules.apar import AparRules


@dataclasses.dataclass(frozen=True)
class SotRules(AparRules):
  name: ClassVar[str] = "sot"
  max_depth: int = 0
  sample_after_script: bool = True
