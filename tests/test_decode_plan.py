"""The decode memory plan (`pasta plan` on a decode config): its pool term equals the pool the decode
loop allocates, Gemma 7B does not fit one v5e chip's share unsplit, and the shipped decode configs fit."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

from pasta_jax.cli import main as cli
from pasta_jax.decode import api, loop
from pasta_jax.errors import ConfigError
from pasta_jax.methods import Sequential, prepare_run
from pasta_jax.training.decode_plan import DecodeConfig, decode_plan, pool_bytes
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_pool_term_is_the_pool_decoding_allocates():
  model = tiny_model()
  prep = prepare_run(model, [[2, 3, 4], [2, 5]], Sequential(), max_new_tokens=8)
  state = loop.start(prep.model_fn, *api.dynamic_args(prep), cfg=loop.static_config(prep.cfg), forced=False,
                     vocab_size=prep.vocab_size, pool_spec=prep.pool_spec)
  real = state.pool.k.nbytes + state.pool.v.nbytes
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  assert pool_bytes(model.config, 2, prep.cfg.pool_slots, jnp.float32, mesh) == real


def test_gemma_7b_needs_a_split_on_v5e():
  one_chip = decode_plan(DecodeConfig("gemma1-7b", "v5e-1", {"data": 1, "fsdp": 1, "tensor": 1}, batch=1))
  assert not one_chip.fits and dict(one_chip.parts)["weights"] > 15 * 2**30  # 8.5B params in bf16
  whole = decode_plan(DecodeConfig("gemma1-7b", "v5e-4", {"data": 4, "fsdp": 1, "tensor": 1}, batch=4))
  split = decode_plan(DecodeConfig("gemma1-7b", "v5e-4", {"data": 1, "fsdp": 1, "tensor": 4}, batch=4))
  assert not whole.fits and "GiB per chip" in whole.reason()
  assert split.fits and dict(split.parts)["weights"] * 4 == pytest.approx(dict(whole.parts)["weights"], rel=0.01)
  with pytest.raises(ConfigError, match="chips"):
    decode_plan(DecodeConfig("gemma1-7b", "v5e-4", {"data": 1, "fsdp": 1, "tensor": 8}))


@pytest.mark.parametrize("config", sorted((ROOT / "tpu_configs").glob("*_decode_*.json")), ids=lambda p: p.stem)
def test_shipped_decode_configs_fit(config, capsys):
  assert cli(["plan", str(config)]) == 0
  assert "fits" in capsys.readouterr().out
