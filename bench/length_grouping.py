"""Training steps on real records, side by side: batches padded to --seq-len against length-grouped batches.

One encode pass over a records file, then the run's step plan both ways (`pipeline.step_batches` with and without
`length_bucket`). Through one real Trainer (the recipe's adapter: LoRA rank 16 on q, k, v, o, gate, up, down, plus
the tag and chat rows) it times the padded shape and every padded length the grouped plan uses, each on the plan's
own batches (`--repeats` timed steps after one that compiles). A whole run's training time is then each plan's
steps times the median step of their length, so the ratio is the time the grouping saves on a run of that plan;
the compiles (one per padded length) are reported beside it.

  python -m bench.length_grouping [--data runs/pasta270m/records/train.jsonl] [--length-bucket 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile

import jax

from pasta_jax.data.encode import EncodeConfig
from pasta_jax.data.pipeline import annotate_records, encode_pool, step_batches
from pasta_jax.data.sources import read_records
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.model.load import BASE, load_model
from pasta_jax.model.mesh import MeshConfig
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.metrics_log import read_metrics
from pasta_jax.training.trainer import Trainer


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.length_grouping", description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default="alpaca_5k",
                      help="records (a shared dataset name or JSONL; annotated structurally where they are not)")
  parser.add_argument("--limit", type=int, default=640, help="records read")
  parser.add_argument("--seq-len", type=int, default=320)
  parser.add_argument("--length-bucket", type=int, default=32)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--epochs", type=int, default=3, help="the run whose time is estimated")
  parser.add_argument("--repeats", type=int, default=2, help="timed steps per padded length (after a compile)")
  return parser.parse_args(argv)


def plan_lengths(ds) -> collections.Counter:
  """How many steps of the plan `ds` run at each padded length."""
  return collections.Counter(ds.padded_length(step) for step in range(len(ds)))


def timing_batches(ds, lengths, repeats: int) -> tuple[list, list[int]]:
  """For each padded length, the plan's first 1 + repeats batches of that length (steps wrap within it)."""
  batches, labels = [], []
  for length in lengths:
    steps = [s for s in range(len(ds)) if ds.padded_length(s) == length]
    picked = [steps[k % len(steps)] for k in range(1 + repeats)]
    batches += [ds[s] for s in picked]
    labels += [length] * len(picked)
  return batches, labels


def time_steps(model, config: TrainConfig, batches: list, labels: list[int]) -> tuple[dict, dict]:
  """(median step seconds, compile step seconds) per padded length, through one Trainer over `batches`."""
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(config, model, batches, out, check_memory=False)
    trainer.run()
    rows = read_metrics(out)
  seconds = collections.defaultdict(list)
  first = {}
  for label, row in zip(labels, rows):
    if label in first:
      seconds[label].append(row["step_seconds"])
    else:
      first[label] = row["step_seconds"]
  return {length: statistics.median(times) for length, times in seconds.items()}, first


def main(argv=None) -> None:
  args = parse_args(argv)
  model = load_model(BASE)
  records = read_records(args.data, args.limit)
  todo = [i for i, r in enumerate(records) if not r.get("annotated")]
  for i, record in zip(todo, annotate_records([records[i] for i in todo], model.tokenizer, progress=True)):
    records[i] = record
  encode = EncodeConfig(seq_len=args.seq_len, num_threads=16)
  pool = encode_pool(records, model.tokenizer, tag_vocab_for(model.tokenizer, encode.position_mode), encode)
  plans = {"padded": step_batches(pool, batch_size=args.batch_size, seed=0, epochs=args.epochs),
           "grouped": step_batches(pool, batch_size=args.batch_size, seed=0, epochs=args.epochs,
                                   length_bucket=args.length_bucket)}
  counts = {name: plan_lengths(ds) for name, ds in plans.items()}
  config = TrainConfig(mesh=MeshConfig(data=len(jax.devices())), batch_size=args.batch_size, seq_len=args.seq_len,
                       num_threads=16, learning_rate=1e-4, lora_rank=16, lora_alpha=16.0,
                       lora_targets=("q", "k", "v", "o", "gate", "up", "down"), save_every=10**9)
  batches, labels = [], []
  for name, ds in plans.items():
    more, more_labels = timing_batches(ds, sorted(counts[name]), args.repeats)
    batches += more
    labels += [(name, length) for length in more_labels]
  step_s, compile_s = time_steps(model, config, batches, labels)
  tokens = {name: sum(length * n for length, n in counts[name].items()) / sum(counts[name].values())
            for name in plans}
  run_s = {name: sum(step_s[(name, length)] * n for length, n in counts[name].items()) for name in plans}
  print(f"{pool.report.summary()}; {len(plans['padded'])} steps of {args.batch_size} ({args.epochs} epochs)")
  print(f"{'plan':>8} {'lengths':>7} {'tokens/row':>10} {'run (min)':>9} {'compiles (s)':>12}  median step by length")
  for name in plans:
    by_length = ", ".join(f"{length}: {step_s[(name, length)]:.2f} s" for length in sorted(counts[name]))
    compiles = sum(compile_s[(name, length)] - step_s[(name, length)] for length in counts[name])
    print(f"{name:>8} {len(counts[name]):>7} {tokens[name]:>10.1f} {run_s[name] / 60:>9.1f} {compiles:>12.0f}  "
          f"{by_length}")
  print(f"RESULT speedup={run_s['padded'] / run_s['grouped']:.3f} "
        f"tokens_ratio={tokens['padded'] / tokens['grouped']:.3f} lengths={len(counts['grouped'])}")


if __name__ == "__main__":
  main()
