"""The interpreter's per-step bookkeeping on any device, with no weights file: a step of the interpreter
against a step of plain decoding, with random Gemma-3-270M-shaped weights. Both run the one step driver
(decode/step.py): PASTA's rules on one lane against the sequential rules (no tags, no constraints), so
the ratio is what PASTA's thread table costs a step.

The interpreter force-replays a synthetic answer (bench.synthetic's) with 1 block (sequential mode:
one lane) and with 4 blocks, with lane buckets on (the default: a `lax.switch` computes only the
rows that lanes feed) and off (always all lanes); under the buckets, with the model's new K/V rows written
after the switch (--defer on) or inside it (--defer off); auto, the default, is the backend's choice
(model/kv_rows.py). Its step time is taken net of plain decoding's
prefill; the plain step is the slope between two lengths. Medians of --repeats runs, each the second
of two.

  python -m bench.seq_cost [--config gemma3-270m] [--tokens 256] [--lanes 8] [--repeats 3] [--dtype bfloat16]
                           [--blocks 1,4] [--buckets on,off] [--defer on,off]
The plain step is also set against the weight-read floor (every weight read once per token at the measured copy
bandwidth): at batch 1 a decoder cannot run faster.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from bench.common import copy_bandwidth, plain_step, run_ids, second_of_two
from bench.synthetic import TEXT, answers, random_model
from pasta_jax.decode.runtime import Runtime
from pasta_jax.methods import Pasta
from pasta_jax.model.kv_rows import defer_by_default


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.seq_cost", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="gemma3-270m")
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--blocks", default="1,4", help="answers of this many blocks (8 blocks: 8 live lanes)")
  parser.add_argument("--buckets", default="on,off", help="lane buckets: on, off or both")
  parser.add_argument("--defer", default="auto",
                      help="K/V writes under the lane buckets: on (deferred), off (in the branch), auto (the "
                           "backend's default: deferred on a CPU only), or a list (on,off)")
  args = parser.parse_args(argv)
  unknown = set(args.defer.split(",")) - {"on", "off", "auto"}
  if unknown:
    parser.error(f"--defer takes on, off or auto, got {', '.join(sorted(unknown))}")
  return args


def weight_roofline(model) -> tuple[float, float]:
  """(seconds a step must take to read every weight once at the measured copy bandwidth, that bandwidth)."""
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
  bandwidth = copy_bandwidth()
  return weight_bytes / bandwidth, bandwidth


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  model = random_model(args.config, dtype)
  prompt = [model.tokenizer.encode("question: " + TEXT)]
  runtime = Runtime(dtype=dtype)
  step, prefill = plain_step(model, prompt[0], answers(args.tokens, 1)[0], args.repeats,
                             max_new_tokens=args.tokens + 64, runtime=runtime)
  floor, bandwidth = weight_roofline(model)
  print(f"device: {jax.devices()[0].device_kind}; {args.config} random weights, {args.dtype}")
  print(f"plain decoding (sequential rules): {1e3 * step:.3f} ms/step ({1 / step:.1f} tokens/s at batch 1), "
        f"prefill {1e3 * prefill:.2f} ms; weight-read floor {1e3 * floor:.3f} ms at {bandwidth / 1e9:.0f} GB/s "
        f"copy bandwidth: {100 * floor / step:.0f}% of the roofline")
  print(f"{'blocks':>6} {'lane_buckets':>12} {'deferred':>8} {'steps':>6} {'ms/step':>8} {'vs plain':>9}")
  ratios, method = {}, Pasta(lanes=args.lanes)
  for blocks in (int(b) for b in args.blocks.split(",")):
    sequential, pasta, _ = answers(args.tokens, blocks)
    for buckets, defer in settings(args):
      kw = dict(max_new_tokens=args.tokens + 64, runtime=runtime, lane_buckets=buckets, defer_kv_writes=defer)
      text = sequential if blocks == 1 else pasta
      runs = [second_of_two(lambda kw=kw, text=text: run_ids(model, prompt, method, forced_answers=[text], **kw)[0])
              for _ in range(args.repeats)]
      per_step = statistics.median((r.seconds - prefill) / r.steps for r in runs)
      ratios[blocks, buckets, defer] = per_step / step
      print(f"{blocks:>6} {buckets!s:>12} {defer!s:>8} {runs[0].steps:>6} {1e3 * per_step:>8.3f} "
            f"{per_step / step:>9.3f}")
  many, default = max(b for b, _, _ in ratios), defer_by_default()
  # The headline figures are the backend's default setting where it was timed, else the first timed.
  pick = lambda blocks, buckets: ratios.get((blocks, buckets, default if buckets else False), next(
      (r for (b, on, _), r in ratios.items() if (b, on) == (blocks, buckets)), float("nan")))
  both = "".join(f" blocks{b}_{'deferred' if d else 'in_branch'}_over_plain={r:.3f}"
                 for (b, on, d), r in ratios.items() if on and len({d for _, o, d in ratios if o}) > 1)
  print(f"RESULT seq_over_plain={pick(1, True):.3f} seq_over_plain_no_buckets={pick(1, False):.3f} "
        f"blocks{many}_over_plain={pick(many, True):.3f} roofline_share={floor / step:.3f}{both}")


def settings(args) -> list[tuple[bool, bool]]:
  """(lane buckets, deferred writes) to time; without buckets there is one branch and nothing to defer."""
  choice = {"on": True, "off": False, "auto": defer_by_default()}
  defers = list(dict.fromkeys(choice[d] for d in args.defer.split(",")))
  return [(on, d) for on in (b == "on" for b in args.buckets.split(",")) for d in (defers if on else [False])]


if __name__ == "__main__":
  main()
