"""`pasta eval`: decoding methods timed against a baseline, judged pairwise, reported and plotted.

Methods by name (the baselines included): `pasta_jax.commands.eval_registry`."""

from pasta_jax.eval.methods import (
  DecodeSettings,
  Method,
  MethodOutput,
  MethodSpec,
)
from pasta_jax.eval.runner import evaluate
from pasta_jax.eval.speed import Aggregate, PromptSpeed, aggregate, prompt_speed
from pasta_jax.eval.winrate import WinRates, length_controlled_winrate, win_rates

__all__ = ["Aggregate", "DecodeSettings", "Method", "MethodOutput", "MethodSpec", "PromptSpeed", "aggregate",
           "evaluate", "length_controlled_winrate", "prompt_speed", "win_rates", "WinRates"]
