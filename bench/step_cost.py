"""Cost of one decode step against the number of query rows Q, training layout vs decode layout.

The interpreter's step decodes one row per live thread, so its parallel speed-up rests on a step
of Q rows costing little more than a step of one. On a CPU a token-major matmul of Q >= 2 rows
repacks the weight and costs far more than one row; the decode layout (weights [out, in],
multiplied weight-major) streams each weight once. This prints the median step time for both
layouts on the real Gemma 3 270M, each Q's cost relative to Q=1, and the logits' largest
difference between the layouts (they compute the same function).

  python -m bench.step_cost [--rows 1 2 3 4 8] [--runs 15] [--slots 320] [--head-dtype bfloat16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.common import median_time, table
from pasta_jax.decode import api
from pasta_jax.model.gemma import Gemma, KVPool
from pasta_jax.model.load import load_model


def jitted_step(apply_fn):
  @jax.jit
  def step(params, tokens, positions, mask, pool, slots, kv_positions):
    out = apply_fn(params, tokens, positions, mask, pool, slots, kv_positions)
    return out.logits, out.kv
  return step


def step_inputs(config, rows: int, slots: int, dtype):
  """One sequence with 100 cached tokens and `rows` new ones that see all of them."""
  filled = 100
  pool_shape = (config.num_layers, 1, slots, config.num_kv_heads, config.head_dim)
  pool = KVPool(jnp.zeros(pool_shape, dtype), jnp.zeros(pool_shape, dtype))
  tokens = (jnp.arange(1, rows + 1) * 7)[None]  # [1, Q]
  positions = jnp.full((1, rows), filled, jnp.int32)  # [1, Q]
  mask = jnp.broadcast_to(jnp.arange(slots)[None, None, :] < filled, (1, rows, slots))  # [1, Q, S]
  write_slots = (jnp.arange(rows) + filled)[None]  # [1, Q]
  kv_positions = jnp.arange(slots)[None]  # [1, S]
  return tokens, positions, mask, pool, write_slots, kv_positions


def measure(step, params, inputs, runs: int):
  logits, _ = step(params, *inputs)
  seconds, _ = median_time(lambda: jax.block_until_ready(step(params, *inputs)), runs)
  return seconds, logits


def head_forms(unembed, rows: int, runs: int) -> dict:
  """The output head alone on `rows` rows, in both forms (`gemma.output_head` picks one by the row count)."""
  x = jnp.ones((1, rows, unembed.shape[1]), unembed.dtype)
  forms = {"head_wm_ms": "bqd,vd->vbq", "head_tm_ms": "bqd,vd->bqv"}
  timed = {}
  for name, spec in forms.items():
    head = jax.jit(lambda x, e, spec=spec: jnp.einsum(spec, x, e, preferred_element_type=jnp.float32))
    jax.block_until_ready(head(x, unembed))
    timed[name] = 1e3 * median_time(lambda head=head: jax.block_until_ready(head(x, unembed)), runs)[0]
  return timed


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.step_cost", description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
  parser.add_argument("--runs", type=int, default=15)
  parser.add_argument("--slots", type=int, default=320)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--model", default=None, help="model path (default: the embedded Gemma 3 270M)")
  parser.add_argument("--head-dtype", default=None, metavar="bfloat16",
                      help="the decode layout's output head in this narrower dtype (api.check_head_dtype)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  model = load_model(args.model or "base")
  dtype = jnp.dtype(args.dtype)
  training_params = jax.tree.map(lambda x: jnp.asarray(x, dtype), model.params)
  layouts = {
      "training": (jitted_step(Gemma(model.config, dtype).apply), training_params),
      "decode": (jitted_step(api.model_fn(model.config, dtype, head_dtype=args.head_dtype)),
                 api.decode_params(model.params, dtype, head_dtype=args.head_dtype)),
  }
  rows, base = [], {}
  for q in args.rows:
    inputs = step_inputs(model.config, q, args.slots, dtype)
    timed = {name: measure(step, params, inputs, args.runs) for name, (step, params) in layouts.items()}
    for name, (seconds, _) in timed.items():
      base.setdefault(name, seconds)
    rows.append({
        "Q": q,
        "train_ms": 1e3 * timed["training"][0],
        "train_vs_Q1": timed["training"][0] / base["training"],
        "decode_ms": 1e3 * timed["decode"][0],
        "decode_vs_Q1": timed["decode"][0] / base["decode"],
        "max_diff": float(jnp.abs(timed["training"][1] - timed["decode"][1]).max()),
        **head_forms(training_params["params"]["embedder"], q, args.runs),
    })
    print(table(rows[-1:], tuple(rows[-1])), flush=True)
  print(table(rows, tuple(rows[0])))
  last = rows[-1]
  print(f"RESULT Q={last['Q']} train_vs_Q1={last['train_vs_Q1']:.3f} decode_vs_Q1={last['decode_vs_Q1']:.3f} "
        f"decode_over_train={last['decode_ms'] / last['train_ms']:.3f}")


if __name__ == "__main__":
  main()
