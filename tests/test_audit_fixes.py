"""Fixes from reading the papers against the code: each rule here failed before its fix."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.rules import PastaRules
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.errors import PastaError
from tests.programs import VOCAB, VOCAB_SIZE

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)


@pytest.mark.parametrize("after_script", [False, True])
def test_oracle_positions_without_a_script_are_refused(after_script):
  """Free decoding has no true block length: the oracle mode must refuse it, not put main at p + 2."""
  cfg = InterpreterConfig(vocab=VOCAB, lanes=2, max_threads=4, pool_slots=64, max_steps=16, position_mode="oracle",
                          rules=PastaRules(sample_after_script=after_script))
  scripts = [[[1, 2]]] if after_script else None
  with pytest.raises(PastaError, match="oracle"):
    run_interpreter(toy_apply, toy_params(TOY, {}), [[1, 2, 3]], cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                    scripts=scripts)


