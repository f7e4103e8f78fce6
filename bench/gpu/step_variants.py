"""Plain decoding's step at batch 1 under variants of the decode layer's projections, one variant per process.

  python -m bench.gpu.step_variants --variant base|rowpad|fused [--tokens 128] [--logits-to F.npy]

base: the model as it is. rowpad: a single query row padded to two in every decode projection (XLA:GPU rewrites a
vector-matrix dot under 1e7 elements as a multiply and a reduction; two rows stay a matrix product). fused: q, k
and v as one projection (their weights concatenated along the output heads, hoisted out of the loop by XLA), gate
and up as one. Prints ms/step and the weight-read roofline share; the logits of the first 8 replayed steps on
request, to set against the base's (bench/gpu/step_variants.sh).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import plain_step
from bench.seq_cost import weight_roofline
from bench.synthetic import TEXT, answers, random_model
from pasta_jax.decode.runtime import Runtime
from pasta_jax.methods import Sequential, generate_ids
from pasta_jax.model import gemma

VARIANTS = ("base", "rowpad", "fused")


def patch_rowpad():
  original = gemma.project

  def project(x, w, in_dims, out_dims, decode_layout, **kw):
    if not decode_layout or x.shape[0] * x.shape[1] != 1:
      return original(x, w, in_dims, out_dims, decode_layout, **kw)
    return original(jnp.concatenate([x, x], axis=1), w, in_dims, out_dims, decode_layout, **kw)[:, :1]

  gemma.project = project


def patch_fused():
  """q|k|v and gate|up as one projection each: the first of a group computes all and keeps the rest for the others."""
  original = gemma.adapted_projection
  groups = {"q": ("q", "k", "v"), "gate": ("gate", "up")}
  kept = {}

  def adapted(module, name, x, in_shape, out_shape, in_dims, out_dims, decode_layout, adapter):
    if not decode_layout or adapter is not None:
      return original(module, name, x, in_shape, out_shape, in_dims, out_dims, decode_layout, adapter)
    key = (id(module), name)
    if key in kept:
      return kept.pop(key)
    if name not in groups:
      return original(module, name, x, in_shape, out_shape, in_dims, out_dims, decode_layout, adapter)
    cfg = module.config
    shapes = {"q": (cfg.num_heads, cfg.head_dim), "k": (cfg.num_kv_heads, cfg.head_dim),
              "v": (cfg.num_kv_heads, cfg.head_dim), "gate": out_shape, "up": out_shape}
    names = groups[name]
    weights = [gemma.projection(module, n, in_shape, shapes[n], x.dtype, True) for n in names]
    y = gemma.project(x, jnp.concatenate(weights, axis=0), in_dims, out_dims, True)
    parts = jnp.split(y, np.cumsum([w.shape[0] for w in weights])[:-1], axis=2)
    for n, part in zip(names[1:], parts[1:]):
      kept[(id(module), n)] = part
    return parts[0]

  gemma.adapted_projection = adapted


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.gpu.step_variants", description=__doc__.split("\n\n")[0])
  parser.add_argument("--variant", default="base", choices=VARIANTS)
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--config", default="gemma3-270m")
  parser.add_argument("--logits-to", default=None, help="save the first 8 replayed steps' logits here (.npy)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.variant == "rowpad":
    patch_rowpad()
  if args.variant == "fused":
    patch_fused()
  dtype = jnp.dtype(args.dtype)
  model = random_model(args.config, dtype)
  prompt = model.tokenizer.encode("question: " + TEXT)
  runtime = Runtime(dtype=dtype)
  if args.logits_to:
    replay = generate_ids(model, [prompt], Sequential(), max_new_tokens=args.tokens + 64, runtime=runtime,
                          forced_answers=[answers(args.tokens, 1)[0]], return_logits=True)[0]
    np.save(args.logits_to, np.asarray(replay.logits[:8], np.float32))
  step, prefill = plain_step(model, prompt, answers(args.tokens, 1)[0], args.repeats,
                             max_new_tokens=args.tokens + 64, runtime=runtime)
  floor, bandwidth = weight_roofline(model)
  line = (f"variant {args.variant}: {1e3 * step:.3f} ms/step, prefill {1e3 * prefill:.2f} ms, floor "
          f"{1e3 * floor:.3f} ms at {bandwidth / 1e9:.0f} GB/s: {100 * floor / step:.1f}% of the roofline")
  print(line)
  print(f"RESULT variant={args.variant} ms_per_step={1e3 * step:.4f} roofline_share={floor / step:.4f} "
        f"device={jax.devices()[0].device_kind.replace(' ', '_')} xla_flags={os.environ.get('XLA_FLAGS', '')!r}")


if __name__ == "__main__":
  main()
