"""Train-step throughput and MFU on the device that runs it.

Synthetic full-length batches (random tokens, the PASTA layout of a 2-fork answer, every position
valid) through the real Trainer step: sharded state, donated buffers, accumulation. Timing is the
median over steps after one warm-up (compile) step; MFU = model FLOPs per token x tokens/s ÷ the
peak of all devices (`training.plan`'s hardware table; `--hardware` picks the entry).

  python -m bench.train [--model PATH|embedded] [--batch-size 4] [--seq-len 256] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import numpy as np

from pasta_jax.lang.layout import layout_example, stack_layouts
from pasta_jax.model.load import load_model
from pasta_jax.training.config import MeshConfig, TrainConfig
from pasta_jax.training.metrics_log import read_metrics
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
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  model = load_model(args.model or "base")
  vocab = model.tokenizer.tag_vocab()
  devices = jax.devices()
  hardware = args.hardware or ("cpu" if devices[0].platform == "cpu" else "h100x1")
  config = TrainConfig(model=args.model or "embedded", mesh=MeshConfig(data=len(devices)), hardware=hardware,
                       batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len, num_threads=3,
                       compute_dtype=args.compute_dtype, remat=args.remat, save_every=10**9)
  data = [synthetic_batch(vocab, model.config.vocab_size, args.batch_size, args.seq_len, k)
          for k in range(args.steps + 1)]
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(config, model, data, out, check_memory=False)
    trainer.run(stop_after=args.steps + 1)
    rows = read_metrics(out)[1:]  # step 0 compiles
  tokens_per_s = statistics.median(r["tokens_per_s"] for r in rows)
  mfu = statistics.median(r["mfu"] for r in rows)
  step_s = statistics.median(r["step_seconds"] for r in rows)
  print(f"{devices[0].platform} x{len(devices)} ({hardware}): batch {args.batch_size} x {args.seq_len} tokens, "
        f"median step {step_s:.2f} s over {len(rows)} steps, loss {rows[-1]['loss']:.3f}")
  print(f"RESULT tokens_per_s={tokens_per_s:.1f} mfu={mfu:.4f}")


if __name__ == "__main__":
  main()
