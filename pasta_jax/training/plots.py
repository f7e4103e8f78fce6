"""Loss-curve plot of a training run (from `<out>/metrics.jsonl`)."""

from __future__ import annotations

import os

from pasta_jax.paths import run_path
from pasta_jax.training.metrics_log import read_metrics


def plot_loss_curve(out_dir: str | os.PathLike, path: str | os.PathLike | None = None, title: str = "",
                    ylabel: str = "token NLL"):
  """Writes the training loss (and a moving average) against the step; returns the PNG path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_metrics(out_dir)
  if not rows:
    raise FileNotFoundError(f"no metrics in {out_dir}")
  steps = [r["step"] for r in rows]
  losses = [r["loss"] for r in rows]
  window = max(1, len(losses) // 20)
  smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, losses, alpha=0.35, label="loss per step")
  ax.plot(steps, smooth, label=f"moving average ({window} steps)")
  ax.set_xlabel("optimizer step")
  ax.set_ylabel(ylabel)
  ax.set_title(title or f"training loss: {run_path(out_dir).name}")
  ax.grid(alpha=0.3)
  ax.legend()
  path = run_path(path) if path else run_path(out_dir) / "loss.png"
  fig.tight_layout()
  with path.open("wb") as f:  # a file object: works for gs:// too
    fig.savefig(f, format="png", dpi=120)
  plt.close(fig)
  return path
