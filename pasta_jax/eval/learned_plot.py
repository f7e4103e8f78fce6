"""The quality-speed trade-off of learned models: each model's quality proxies against its realized speedup.

One point per PASTA row (its geometric-mean realized speedup over Baseline-SFT) and one for Baseline-SFT itself at
1.0x, in one panel per quality proxy the figures hold: ROUGE-L against the reference answers, log p per token under
the scorer (Baseline-SFT unless told), log p under the base model, the share of duplicate sibling blocks and of
answers cut at the token budget. Up and to the right is better on the first three, down and to the right on the
last two; a lambda sweep of BoNBoN rounds traces the Pareto front, and rows of one model at several fork biases
are joined in the order of the bias (the decode-time knob's curve).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

# (key in a figure's "pasta"/"baseline" dicts, axis label, higher is better)
PANELS = (("rouge_l", "ROUGE-L vs reference answer", True),
          ("logprob", "log p per token under {scorer}", True),
          ("logprob_base", "log p per token under the base model", True),
          ("duplicate_rate", "duplicate sibling blocks (share)", False),
          ("truncated", "answers cut at the token budget (share)", False))
SPEEDS = ("realized", "theoretical")


def plot_quality_pareto(figures: Mapping[str, Mapping], path: str | os.PathLike, title: str = "") -> str:
  """figures: method name -> `learned_figures(...)` output (realized, pasta{...}, baseline{...})."""
  return plot_series({"": figures}, path, title)


def plot_series(series: Mapping[str, Mapping[str, Mapping]], path: str | os.PathLike, title: str = "",
                speed: str = "realized") -> str:
  """series: label -> {row name -> `learned_figures` output}, one colour each; every series' figures must share
  one baseline run (its point is the first figure's). speed: the x axis, "realized" (wall time) or "theoretical"
  (steps: what runs timed on different days still compare by, since a machine's speed drifts between them)."""
  if speed not in SPEEDS:
    raise ValueError(f"speed must be one of {SPEEDS}, got {speed!r}")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = [f for figures in series.values() for f in figures.values()]
  if not rows:
    raise ValueError("no models to plot")
  panels = [p for p in PANELS if any(math.isfinite(f["pasta"].get(p[0], math.nan)) for f in rows)]
  columns = min(3, len(panels))
  lines = -(-len(panels) // columns)
  fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 4.2 * lines), squeeze=False)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  baseline, scorer = rows[0]["baseline"], rows[0].get("scorer", "Baseline-SFT")  # bench.learned --scorer
  for ax, (key, label, higher) in zip(axes.flat, panels):
    if math.isfinite(baseline.get(key, math.nan)):
      ax.scatter([1.0], [baseline[key]], marker="s", color="black", zorder=3)
      ax.annotate("Baseline-SFT", (1.0, baseline[key]), textcoords="offset points", xytext=(6, -12), fontsize=7)
    for i, (name, figures) in enumerate(series.items()):
      _plot_one_series(ax, series_points(figures, key, speed), name, f"C{i}")
    ax.set_xlabel(f"{speed} speedup vs Baseline-SFT (geo)")
    ax.set_ylabel(label.format(scorer=scorer) + ("" if higher else " (lower is better)"))
    ax.grid(alpha=0.3)
  if len(series) > 1 or next(iter(series)):
    axes[0][0].legend(fontsize=7, loc="best")
  fig.suptitle(title or f"quality vs speed, {rows[0]['n']} prompts")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return str(path)


def series_points(figures: Mapping[str, Mapping], key: str, speed: str) -> list[tuple[float, float, str, float]]:
  """(speedup, proxy, row name, fork bias) for each row with both figures finite."""
  return [(f[speed], f["pasta"][key], name, f.get("fork_bias", 0.0)) for name, f in figures.items()
          if math.isfinite(f["pasta"].get(key, math.nan)) and math.isfinite(f.get(speed, math.nan))]


def _plot_one_series(ax, points: list[tuple[float, float, str, float]], label: str, color: str) -> None:
  if not points:
    return
  ax.scatter([p[0] for p in points], [p[1] for p in points], color=color, zorder=3, label=label or None)
  biases = {p[3] for p in points}
  if len(biases) > 1:  # one model at several fork biases: its curve, in the order of the bias
    curve = sorted(points, key=lambda p: p[3])
    ax.plot([p[0] for p in curve], [p[1] for p in curve], color=color, alpha=0.5, zorder=2)
  for x, y, name, bias in points:
    text = f"bias {bias:g}" if len(biases) > 1 else _short(name)
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7, color=color)


def _short(name: str) -> str:
  """`pasta:runs/g6/bonbon_l1/round_1/train/model` -> `g6/bonbon_l1`: enough to tell the runs apart."""
  name = name.split("@", 1)[0]
  parts = [p for p in name.split(":", 1)[-1].split("/") if p not in ("runs", "round_1", "train", "model")]
  return "/".join(parts[-2:]) or name
