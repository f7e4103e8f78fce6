"""The cost of a sampled row against a greedy one: `sample_rows` on a batch of rows over a Gemma-size vocabulary.

Every configuration is one batch of --rows rows with the same settings, each compiled once (for its own envelope,
as `generate` compiles a request's) before timing; each of --rounds rounds then times every configuration once
(a slow spell of a shared machine lands on all alike), and each keeps its median. The logits are normal with
standard deviation --scale (3: top-p 0.9 keeps about 12k of 262k tokens and 0.5 about 450, wide nuclei), and every
round draws with new keys. `greedy rows, every path` is greedy rows in the program a server runs (`ANY_SAMPLING`).
A batch of hot rows skips the argmax, so a sampled batch can cost less than a greedy one.

  python -m bench.sampling [--rows 16] [--vocab 262144] [--rounds 15] [--scale 3]
Last line: RESULT temperature_vs_greedy=... top_k_vs_greedy=... top_p_vs_greedy=... top_p_half_vs_greedy=...
(time ratios to the greedy batch's: below 1 is cheaper than greedy).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from bench.common import table
from pasta_jax.decode.sampling import ANY_SAMPLING, RowSampling, SamplingConfig, sample_rows

CONFIGS = {
  "greedy": (SamplingConfig(), None),
  "greedy rows, every path": (SamplingConfig(), ANY_SAMPLING),
  "temperature 1": (SamplingConfig(temperature=1.0), None),
  "top_k 50": (SamplingConfig(temperature=1.0, top_k=50), None),
  "top_p 0.9": (SamplingConfig(temperature=1.0, top_p=0.9), None),
  "top_p 0.5": (SamplingConfig(temperature=1.0, top_p=0.5), None),
  "top_k 50, top_p 0.9": (SamplingConfig(temperature=1.0, top_k=50, top_p=0.9), None),
}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.sampling", description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--vocab", type=int, default=262144)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation")
  return parser.parse_args(argv)


def programs(rows: int) -> dict:
  """{name: (jitted sample_rows for its envelope, its rows' settings on device)}."""
  built = {}
  for name, (cfg, envelope) in CONFIGS.items():
    envelope = (envelope or cfg).envelope()
    built[name] = (jax.jit(lambda logits, keys, r, envelope=envelope: sample_rows(logits, keys, r, envelope)),
                   jax.tree.map(jnp.asarray, RowSampling.of([cfg] * rows)))
  return built


def main(argv=None) -> None:
  args = parse_args(argv)
  logits = jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32) * args.scale
  built = programs(args.rows)
  keys = lambda i: jax.random.split(jax.random.key(i + 1), args.rows)
  for fn, rows in built.values():
    jax.block_until_ready(fn(logits, keys(0), rows))
  times = {name: [] for name in built}
  for i in range(args.rounds):
    round_keys = keys(i + 1)
    jax.block_until_ready(round_keys)
    for name, (fn, rows) in built.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(logits, round_keys, rows))
      times[name].append(time.perf_counter() - start)
  median = {name: statistics.median(t) for name, t in times.items()}
  print(f"{args.rows} rows x {args.vocab} logits (normal, std {args.scale}); {jax.default_backend()} "
        f"({platform.processor() or platform.machine()}), jax {jax.__version__}; medians of {args.rounds} rounds")
  print(table([{"configuration": name, "ms": 1e3 * median[name], "min_ms": 1e3 * min(times[name]),
                "vs_greedy": median[name] / median["greedy"]} for name in built],
              ("configuration", "ms", "min_ms", "vs_greedy"), width=24))
  ratio = lambda name: median[name] / median["greedy"]
  print(f"RESULT temperature_vs_greedy={ratio('temperature 1'):.3f} top_k_vs_greedy={ratio('top_k 50'):.3f} "
        f"top_p_vs_greedy={ratio('top_p 0.9'):.3f} top_p_half_vs_greedy={ratio('top_p 0.5'):.3f}")


if __name__ == "__main__":
  main()
