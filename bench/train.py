"""Train-step throughput and MFU on the device that runs it.

Synthetic full-length batches (random tokens, the PASTA layout of a 2-fork answer, every position
valid) through the real Trainer step: sharded state, donated buffers, accumulation. Timing is the
median over steps after one warm-up (compile) step; MFU = model FLOPs per token x tokens/s ÷ the
peak of all devices (`training.plan`'s hardware table; `--hardware` picks the entry).

  python -m bench.train [--model PATH|embedded] [--batch-size 4] [--seq-len 256] [--steps 5]
  python -m bench.train --config tpu_configs/gemma7b_sft_h100x1.json [--steps 2] [--set lora_rank=16]

With --config, the run is that file's (model, batch, accumulation, dtypes, remat, hardware); a preset model name
(gemma1-7b) trains random weights in the real shapes, and the device's peak memory is set against `pasta plan`'s
prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.synthetic import random_model
from pasta_jax.lang.layout import layout_example, stack_layouts
from pasta_jax.model.config import PRESETS
from pasta_jax.model.load import load_model
from pasta_jax.model.mesh import MeshConfig
from pasta_jax.training.config import TrainConfig, load_train_config
from pasta_jax.training.metrics_log import read_metrics
from pasta_jax.training.plan import plan_for
from pasta_jax.training.trainer import Trainer


def synthetic_batch(vocab, vocab_size: int, batch: int, seq_len: int, seed: int):
  """[B, seq_len] layouts of prompt + main text + two forks, filling the sequence exactly."""
  rng = np.random.default_rng(seed)
  block = max(10, (seq_len // 4) // 10 * 10)  # two blocks of ~1/4 of the sequence each
  prompt_len = seq_len // 8
  overhead = 2 * (block + 5)  # promise, topic, LENGTH, <async>, </async> around each block's content
  main_len = seq_len - prompt_len - overhead - 1  # -1: end id
  text = lambda n: [int(t) for t in rng.integers(1000, vocab_size - 1000, n)]
  length_tok = vocab.length_token(block)
  layouts = []
  for _ in range(batch):
    fork = lambda: [vocab.promise, *text(1), length_tok, vocab.async_open, *text(block), vocab.async_close]
    answer = text(main_len // 2) + fork() + fork() + text(main_len - main_len // 2)
    layouts.append(layout_example(text(prompt_len), answer, vocab, length=seq_len, num_threads=3))
  return stack_layouts(layouts)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.train", description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default=None, help="model path (default: the embedded Gemma 3 270M)")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--grad-accum", type=int, default=1)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--compute-dtype", default="float32")
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--hardware", default=None, help="key of training.plan.HARDWARE (default: by platform)")
  parser.add_argument("--config", default=None, help="a TrainConfig JSON (tpu_configs/*.json): overrides the flags")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                      help="change one field of --config's TrainConfig (e.g. --set lora_rank=16); repeatable")
  return parser.parse_args(argv)


def flag_config(args, model_name: str) -> TrainConfig:
  devices = jax.devices()
  hardware = args.hardware or ("cpu" if devices[0].platform == "cpu" else "h100x1")
  return TrainConfig(model=model_name, mesh=MeshConfig(data=len(devices)), hardware=hardware,
                     batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len, num_threads=3,
                     compute_dtype=args.compute_dtype, remat=args.remat, save_every=10**9)


def field_changes(pairs: list[str]) -> dict:
  """["lora_rank=16", 'attention="pallas"'] -> {"lora_rank": 16, "attention": "pallas"} (values as JSON, else text)."""
  changes = {}
  for pair in pairs:
    field, sep, value = pair.partition("=")
    if not sep:
      raise SystemExit(f"--set wants FIELD=VALUE, got {pair!r}")
    try:
      changes[field] = json.loads(value)
    except json.JSONDecodeError:
      changes[field] = value
  return changes


def peak_memory_line(config: TrainConfig) -> str:
  """The device's peak bytes against the plan's prediction (empty where the device keeps no statistics)."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" not in stats:
    return ""
  peak, predicted = stats["peak_bytes_in_use"], plan_for(config).peak
  return (f"peak device memory {peak / 2**30:.1f} GiB; `pasta plan` predicted {predicted / 2**30:.1f} GiB "
          f"(measured / predicted {peak / predicted:.2f})")


def main(argv=None):
  args = parse_args(argv)
  if args.config:
    config = load_train_config(args.config, **field_changes(args.set)).replace(save_every=10**9)
    model = (random_model(config.model, jnp.dtype(config.param_dtype)) if config.model in PRESETS
             else load_model(config.model))
  else:
    model = load_model(args.model or "base")
    config = flag_config(args, args.model or "embedded")
  data = [synthetic_batch(model.tokenizer.tag_vocab(), model.config.vocab_size, config.batch_size, config.seq_len, k)
          for k in range(args.steps + 1)]
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(config, model, data, out, check_memory=False)
    trainer.run(stop_after=args.steps + 1)
    rows = read_metrics(out)[1:]  # step 0 compiles
  tokens_per_s = statistics.median(r["tokens_per_s"] for r in rows)
  mfu = statistics.median(r["mfu"] for r in rows)
  step_s = statistics.median(r["step_seconds"] for r in rows)
  devices = jax.devices()
  print(f"{devices[0].platform} x{len(devices)} ({config.hardware}): {config.model}, batch {config.batch_size} x "
        f"{config.seq_len} tokens in {config.grad_accum} micro-batches, median step {step_s:.2f} s over {len(rows)} "
        f"steps, loss {rows[-1]['loss']:.3f}")
  memory = peak_memory_line(config) if config.model in PRESETS else ""
  if memory:
    print(memory)
  print(f"RESULT tokens_per_s={tokens_per_s:.1f} mfu={mfu:.4f} step_s={step_s:.3f}")

if __name__ == "__main__":
  main()
