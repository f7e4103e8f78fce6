"""The quality-speed trade-off of learned models: each model's quality proxies against its realized speedup.

One point per PASTA model (its geometric-mean realized speedup over Baseline-SFT) and one for Baseline-SFT
itself at 1.0x, in two panels: ROUGE-L against the reference answers, and log p per token under Baseline-SFT.
Up and to the right is better; a lambda sweep of BoNBoN rounds traces the Pareto front.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

PANELS = (("rouge_l", "ROUGE-L vs reference answer"), ("logprob", "log p per token under Baseline-SFT"))


def plot_quality_pareto(figures: Mapping[str, Mapping], path: str | os.PathLike, title: str = "") -> str:
  """figures: method name -> `learned_figures(...)` output (realized, pasta{...}, baseline{...})."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if not figures:
    raise ValueError("no models to plot")
  fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2))
  baseline = next(iter(figures.values()))["baseline"]
  scorer = next(iter(figures.values())).get("scorer", "Baseline-SFT")  # bench.learned --scorer
  for ax, (key, label) in zip(axes, PANELS):
    label = label.replace("Baseline-SFT", scorer) if key == "logprob" else label
    if math.isfinite(baseline.get(key, math.nan)):
      ax.scatter([1.0], [baseline[key]], marker="s", color="black", zorder=3)
      ax.annotate("Baseline-SFT", (1.0, baseline[key]), textcoords="offset points", xytext=(6, -12), fontsize=8)
    for name, f in figures.items():
      value = f["pasta"].get(key, math.nan)
      if not math.isfinite(value):
        continue
      ax.scatter([f["realized"]], [value], zorder=3)
      ax.annotate(_short(name), (f["realized"], value), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("realized speedup vs Baseline-SFT (geo)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  fig.suptitle(title or f"quality vs speed, {next(iter(figures.values()))['n']} prompts")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return str(path)


def _short(name: str) -> str:
  """`pasta:runs/g6/bonbon_l1/round_1/train/model` -> `g6/bonbon_l1`: enough to tell the runs apart."""
  parts = [p for p in name.split(":", 1)[-1].split("/") if p not in ("runs", "round_1", "train", "model")]
  return "/".join(parts[-2:]) or name
