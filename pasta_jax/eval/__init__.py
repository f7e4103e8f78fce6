"""`pasta eval`: decoding methods timed against a baseline, judged pairwise, reported and plotted."""

from pasta_jax.eval.methods import (
  METHODS,
  DecodeSettings,
  Method,
  MethodOutput,
  MethodSpec,
  build_method,
  parse_spec,
  register_method,
)
from pasta_jax.eval.runner import evaluate
from pasta_jax.eval.speed import Aggregate, PromptSpeed, aggregate, prompt_speed
from pasta_jax.eval.winrate import WinRates, length_controlled_winrate, win_rates

__all__ = ["METHODS", "Aggregate", "DecodeSettings", "Method", "MethodOutput", "MethodSpec", "PromptSpeed",
           "aggregate", "build_method", "evaluate", "length_controlled_winrate", "parse_spec", "prompt_speed",
           "register_method", "win_rates", "WinRates"]
