"""bench.loop_kernels reads the work of one decode step from the compiled program, and the PASTA step keeps the
shape it measured on a GPU: one lane-count conditional, no loop inside the step."""

import jax
import jax.numpy as jnp
import pytest

from bench.loop_kernels import decode_loop, launches, parse_module
from pasta_jax.decode import api, loop
from pasta_jax.decode.rules.base import lane_buckets
from pasta_jax.methods import Pasta, prepare_run
from tests.tiny import tiny_model

pytestmark = pytest.mark.production_xla  # counts kernels of the program XLA's default flags compile


def compiled_loop(text: str):
  computations, entry = parse_module(text)
  return launches(computations, decode_loop(computations, entry))


def test_a_step_counts_inner_loops_by_trip_count_and_conditionals_by_branch():
  def step(carry):
    i, x = carry
    x = jax.lax.switch(i % 3, [lambda v: v + 1.0, lambda v: jnp.sin(v) * 2.0, lambda v: jnp.cos(v) - v], x)
    x = jax.lax.fori_loop(0, 5, lambda j, v: jnp.tanh(v) * j, x)  # a known trip count: 5 runs of its body
    return i + 1, x

  text = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 10, step, (0, x))[1]).lower(
      jnp.ones(64)).compile().as_text()
  outside, branches = compiled_loop(text)
  assert outside["while-condition"] == 6  # the inner loop's condition runs 5 + 1 times a step
  assert [len(b) for b in branches] == [3]
  assert all(sum(b.values()) >= 1 for b in branches[0])


def test_the_pasta_step_has_one_lane_bucket_conditional_and_no_inner_loop():
  # jnp.searchsorted picked the bucket with a while loop: ~19 kernels of a 556-kernel step on an H200
  model = tiny_model()
  lanes = 4
  prep = prepare_run(model, [model.tokenizer.encode("hi")], Pasta(lanes=lanes), max_new_tokens=8)
  outside, branches = compiled_loop(api.COMPILED.get(prep, loop.prefill_and_run).as_text())
  assert "while-condition" not in outside, outside
  assert [len(b) for b in branches] == [len(lane_buckets(lanes))]
