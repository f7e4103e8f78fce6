"""Pairwise judges: the interface (base), an OpenAI-compatible HTTP judge, a local-model judge, a
resumable cache, and judges by name (factory). Preference scoring (training) and `pasta eval` (quality)
share them, so a verdict means the same thing in both places."""

from __future__ import annotations

from pasta_jax.endpoint import EndpointConfig, EndpointError
from pasta_jax.judges.base import Judge, Verdict, judge_both_orders
from pasta_jax.judges.cache import CachedJudge
from pasta_jax.judges.factory import make_judge
from pasta_jax.judges.http import HttpJudge
from pasta_jax.judges.local import LocalJudge, LocalJudgeError

__all__ = ["CachedJudge", "EndpointConfig", "EndpointError", "HttpJudge", "Judge", "LocalJudge", "LocalJudgeError",
           "Verdict", "judge_both_orders", "make_judge"]
