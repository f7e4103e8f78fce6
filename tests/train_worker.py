"""Trains the tiny model in its own process so a test can SIGKILL it mid-run.

  python -m tests.train_worker OUT_DIR [STEPS]
"""

from __future__ import annotations

import sys

from pasta_jax.training.config import TrainConfig
from pasta_jax.training.trainer import Trainer
from tests import training_data
from tests.tiny import tiny_model

CONFIG = TrainConfig(model="tiny", batch_size=4, seq_len=112, num_threads=4, learning_rate=1e-3, save_every=2)


def cyclic(batches: list, steps: int) -> list:
  return [batches[k % len(batches)] for k in range(steps)]


def make_trainer(out_dir: str, steps: int) -> Trainer:
  model = tiny_model()
  data = cyclic(training_data.batches(model.tokenizer), steps)
  trainer = Trainer(CONFIG, model, data, out_dir, check_memory=False, progress=False)
  trainer._mfu = lambda tokens, seconds: 0.0
  return trainer


if __name__ == "__main__":
  make_trainer(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200).run()
