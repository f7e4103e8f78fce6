"""Training metrics: a JSONL file (always), TensorBoard (when installed), throughput and MFU.

MFU counts the model FLOPs of every token the step computes (padding included, since it is
computed): 6 x (matmul params + the tied output projection) per token, plus the attention score
and value matmuls over the full [L, L] mask (12 x layers x heads x head_dim x L per token).
"""

from __future__ import annotations

import json
import os
import time

from pasta_jax.model import runfiles
from pasta_jax.model.config import GemmaConfig
from pasta_jax.paths import is_remote, run_path


def matmul_params(config: GemmaConfig) -> int:
  """Parameters that take part in a matmul per token (the embedding lookup excluded, the head included)."""
  d, h, k, hd, f = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_dim
  per_layer = d * hd * (h + 2 * k) + h * hd * d + 3 * d * f
  return config.num_layers * per_layer + config.vocab_size * d


def train_flops_per_token(config: GemmaConfig, seq_len: int) -> float:
  attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
  return 6.0 * matmul_params(config) + attention


class MetricsLog:
  """Appends one JSON object per logged step to `<out>/metrics.jsonl`; mirrors scalars to TensorBoard."""

  def __init__(self, out_dir: str | os.PathLike, enabled: bool = True):
    self.enabled = enabled
    self.path = run_path(out_dir) / "metrics.jsonl"
    self.remote = is_remote(out_dir)
    self.lines = self.path.read_text().splitlines(keepends=True) if enabled and self.path.exists() else []
    self.writer = None
    if enabled:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      try:
        from tensorboardX import SummaryWriter  # optional
        self.writer = SummaryWriter(str(run_path(out_dir) / "tensorboard"))
      except ImportError:
        self.writer = None

  def write(self, step: int, values: dict[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": step, "time": time.time(), **{k: float(v) for k, v in values.items()}}
    if self.remote:  # object stores cannot append: rewrite the (small) file, whole
      self.lines.append(json.dumps(record) + "\n")
      self.path.write_text("".join(self.lines))
    else:  # after cutting a row a kill left torn
      runfiles.append_row(self.path, record)
    if self.writer is not None:
      for key, value in values.items():
        self.writer.add_scalar(key, float(value), step)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def read_metrics(out_dir: str | os.PathLike) -> list[dict]:
  """The logged rows; a line a kill cut in half is left out (not cut from the file: the job may be running)."""
  path = run_path(out_dir) / "metrics.jsonl"
  if not path.exists():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:  # a line cut by a kill, or being written
      continue
  return rows
