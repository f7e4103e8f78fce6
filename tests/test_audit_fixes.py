"""Fixes from reading the papers against the code (issue 15): each rule here failed before its fix."""

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


def test_compile_cache_keeps_executables_for_the_next_process(tmp_path):
  """With the cache on, the second process finds the first's entries."""
  import subprocess
  import sys
  program = ("import sys, jax, jax.numpy as jnp; from pathlib import Path; from pasta_jax import compile_cache; "
             "compile_cache.enable(Path(sys.argv[1])); print(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).sum())")
  subprocess.run([sys.executable, "-c", program, str(tmp_path)], check=True, capture_output=True)
  assert any(tmp_path.iterdir()), "the first run wrote no cache entry"


def test_compile_cache_flag_and_setting(monkeypatch, tmp_path):
  from pasta_jax import cli, compile_cache
  assert cli.build_parser().parse_args(["--compile-cache", "plan", "x.json"]).compile_cache is True
  assert cli.build_parser().parse_args(["plan", "x.json"]).compile_cache is False
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  assert compile_cache.cache_folder() is None and compile_cache.cache_folder(requested=True) is not None
  monkeypatch.setenv(compile_cache.ENV, "off")
  assert compile_cache.cache_folder(requested=True) is None
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
  assert compile_cache.cache_folder() == tmp_path
  assert compile_cache.enable(None) is None
