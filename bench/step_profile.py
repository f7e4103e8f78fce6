"""Where a decode step's time goes on the device: the kernels of one step of plain decoding against one step of
the PASTA interpreter on one lane, read from a JAX profiler trace.

Both force-replay bench.synthetic's one-block answer (as bench.seq_cost does) with random weights in a preset's
real shapes; each run is traced after a warm-up run. Per step: kernels launched, device busy time (the sum of
kernel durations) and wall time; then the kernel families (names without their numbers) that cost the most, and
what the interpreter adds. On a CPU there are no device kernels to read; the trace then holds only host threads.

  python -m bench.step_profile [--config gemma3-270m] [--dtype bfloat16] [--tokens 256] [--top 12] [--trace-dir D]
Last line: RESULT plain_kernels_per_step=... pasta_kernels_per_step=... plain_busy_ms=... pasta_busy_ms=...
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import tempfile

import jax
import jax.numpy as jnp

from bench.loop_kernels import family
from bench.synthetic import TEXT, answers, random_model
from pasta_jax.decode.runtime import Runtime
from pasta_jax.methods import Pasta, Sequential, generate_ids


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.step_profile", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="gemma3-270m")
  parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temporary folder)")
  return parser.parse_args(argv)


def device_kernels(trace_dir: str) -> list[tuple[str, float]]:
  """(name, microseconds) of every kernel on a device stream in the perfetto trace under `trace_dir`."""
  path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"]["name"]  # noqa: E731
                       for e in events if e.get("ph") == "M" and e.get("name") == kind}
  processes, threads = meta("process_name"), meta("thread_name")
  on_device = [e for e in events if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:")]
  streams = [e for e in on_device if threads.get((e["pid"], e["tid"]), "").startswith("Stream")]
  return [(e["name"], float(e.get("dur", 0.0))) for e in (streams or on_device)]


def profile(run, trace_dir: str):
  """(kernels, steps, wall seconds) of one traced call of `run` after a warm-up call."""
  run()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    result = run()
  return device_kernels(trace_dir), result.steps, result.seconds


def summary(label: str, kernels, steps: int, seconds: float) -> dict:
  busy = sum(d for _, d in kernels) / 1e3
  row = dict(label=label, kernels=len(kernels) / steps, busy_ms=busy / steps, wall_ms=1e3 * seconds / steps)
  print(f"{label:>6}: {row['kernels']:.1f} kernels/step, device busy {row['busy_ms']:.3f} ms/step, "
        f"wall {row['wall_ms']:.3f} ms/step (prefill included)")
  return row


def by_family(kernels, steps: int) -> dict[str, tuple[float, float]]:
  """family -> (launches per step, microseconds per step)."""
  count, time = collections.Counter(), collections.Counter()
  for name, dur in kernels:
    count[family(name)] += 1
    time[family(name)] += dur
  return {k: (count[k] / steps, time[k] / steps) for k in count}


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  model = random_model(args.config, dtype)
  prompt = [model.tokenizer.encode("question: " + TEXT)]
  text = answers(args.tokens, 1)[0]
  kw = dict(max_new_tokens=args.tokens + 64, runtime=Runtime(dtype=dtype), forced_answers=[text])
  runs = {"plain": lambda: generate_ids(model, prompt, Sequential(), **kw)[0],
          "pasta": lambda: generate_ids(model, prompt, Pasta(lanes=args.lanes), **kw)[0]}
  print(f"device: {jax.devices()[0].device_kind}; {args.config} random weights, {args.dtype}, {args.tokens} tokens")
  rows, families = {}, {}
  with tempfile.TemporaryDirectory() as scratch:
    for label, run in runs.items():
      kernels, steps, seconds = profile(run, f"{args.trace_dir or scratch}/{label}")
      rows[label] = summary(label, kernels, steps, seconds)
      families[label] = by_family(kernels, steps)
  names = sorted(set(families["plain"]) | set(families["pasta"]),
                 key=lambda k: -max(families["pasta"].get(k, (0, 0))[1], families["plain"].get(k, (0, 0))[1]))
  print(f"{'kernel family':<48} {'plain n':>8} {'plain us':>9} {'pasta n':>8} {'pasta us':>9}")
  for name in names[: args.top]:
    (pn, pt), (qn, qt) = families["plain"].get(name, (0, 0)), families["pasta"].get(name, (0, 0))
    print(f"{name[:48]:<48} {pn:>8.1f} {pt:>9.1f} {qn:>8.1f} {qt:>9.1f}")
  print(f"RESULT plain_kernels_per_step={rows['plain']['kernels']:.1f} pasta_kernels_per_step="
        f"{rows['pasta']['kernels']:.1f} plain_busy_ms={rows['plain']['busy_ms']:.3f} "
        f"pasta_busy_ms={rows['pasta']['busy_ms']:.3f}")


if __name__ == "__main__":
  main()
