"""`pareto.png`: quality against realized speedup, with the paper's published points for reference.

Judged runs: x = realized speedup (geometric mean), y = LC win rate (raw win rate where the LC one is
unavailable, and the point says so), our methods as labelled points, the paper's as grey markers.
Unjudged runs have no quality axis: the plot shows theoretical against realized speedup instead (each
prompt a faint dot, the geometric means labelled, the line where realized equals theoretical), with the
paper's realized speedups as dotted verticals (the text gives no theoretical numbers), and says so.
"""

from __future__ import annotations

import math
from pathlib import Path

from pasta_jax.eval.published import PAPER_POINTS

LABEL_BOX = dict(boxstyle="round,pad=0.2", fc="white", alpha=0.8, lw=0)  # keeps labels legible over lines
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def write_pareto(results: dict, path: str | Path) -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  methods = [m for m in results["methods"]
             if m["role"] == "method" and defined(m["speed"]["realized_speedup"]["geometric"])]
  fig, ax = plt.subplots(figsize=(8, 6))
  if results["judge"]["judged"]:
    draw_quality(ax, methods, results["n_prompts"])
  else:
    draw_speed_only(ax, methods, results)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2)  # under the axes: hides no point
  fig.tight_layout()
  path = Path(path)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def defined(value) -> bool:
  return value is not None and math.isfinite(value)


def quality_value(method: dict) -> tuple[float, str]:
  """(y value, which win rate) of a judged method: LC when the GLM could be fit, raw otherwise."""
  q = method["quality"]
  if defined(q["lc_win_rate"]):
    return q["lc_win_rate"], "LC"
  return q["win_rate"], "raw"


def draw_quality(ax, methods: list[dict], n_prompts: int) -> None:
  for point in PAPER_POINTS:
    marker = "X" if point.realized_speedup == 1.0 else "s"
    ax.scatter(point.realized_speedup, point.lc_win_rate, marker=marker, s=55, color="0.55", zorder=2)
    ax.annotate(f"paper: {point.label}", (point.realized_speedup, point.lc_win_rate), textcoords="offset points",
                xytext=(5, -11), fontsize=7, color="0.4")
  ax.scatter([], [], marker="s", color="0.55", label="paper (Gemma 7B, H100, GPT-4 judge)")
  pasta = sorted((p for p in PAPER_POINTS if p.label.startswith("Pasta")), key=lambda p: p.realized_speedup)
  ax.plot([p.realized_speedup for p in pasta], [p.lc_win_rate for p in pasta], ls="--", color="0.7", lw=1, zorder=1,
          label="paper: PASTA models' frontier")
  for color, method in zip(COLORS * 4, methods):
    x = method["speed"]["realized_speedup"]["geometric"]
    y, kind = quality_value(method)
    ax.scatter(x, y, s=90, color=color, zorder=3, label=f"{method['name']} (vs {method['reference']}; {kind})")
    ax.annotate(f"{method['name']}\n{x:.2f}x, {y:.1f}% {kind}", (x, y), textcoords="offset points", xytext=(7, 5),
                fontsize=8, color=color, bbox=LABEL_BOX)
  ax.margins(x=0.08, y=0.1)
  lo, hi = ax.get_xlim()
  ax.set_xlim(lo, hi + 0.15 * (hi - lo))  # room for the labels, which sit right of their points
  ax.axhline(50, color="0.8", lw=0.8, zorder=1)
  ax.axvline(1, color="0.8", lw=0.8, zorder=1)
  ax.set_xlabel("realized speedup vs reference (geometric mean; >1 is faster)")
  ax.set_ylabel("win rate vs reference, % (LC unless marked raw)")
  ax.set_title(f"Quality vs realized speedup, {n_prompts} prompts (top right is better)")


def draw_speed_only(ax, methods: list[dict], results: dict) -> None:
  top = 1.0
  for color, method in zip(COLORS * 4, methods):
    xs, ys = per_prompt(results, method["name"])
    ax.scatter(xs, ys, s=14, color=color, alpha=0.35, zorder=2)
    x = method["speed"]["realized_speedup"]["geometric"]
    y = method["speed"]["theoretical_speedup"]["geometric"]
    if not defined(y):
      continue
    ax.scatter(x, y, s=110, color=color, edgecolor="black", zorder=3,
               label=f"{method['name']} vs {method['reference']}: geometric mean (dots: prompts)")
    ax.annotate(f"{method['name']}\nrealized {x:.2f}x, theoretical {y:.2f}x", (x, y), textcoords="offset points",
                xytext=(8, -22), fontsize=8, color=color, bbox=LABEL_BOX)
    top = max([top, *xs, *ys])
  top = top * 1.08
  ax.plot([0, top], [0, top], ls="--", color="0.5", lw=1, label="realized = theoretical")
  for x, labels in paper_speedups():
    ax.axvline(x, ls=":", color="0.7", lw=1)
    ax.text(x, 0.02, f" paper: {', '.join(labels)}", rotation=90, fontsize=7, color="0.45",
            transform=ax.get_xaxis_transform(), va="bottom", ha="right")
  ax.set_xlim(0, max(top, 2.1))
  ax.set_ylim(0, top)
  ax.set_xlabel("realized speedup vs reference (wall time, second of two runs)")
  ax.set_ylabel("theoretical speedup (reference tokens / critical path)")
  ax.set_title(f"Quality not judged: theoretical vs realized speedup, {results['n_prompts']} prompts\n"
               "(dotted: the paper's realized speedups, Gemma 7B on H100)", fontsize=10)


def paper_speedups(close: float = 0.05) -> list[tuple[float, list[str]]]:
  """The paper's realized speedups (no baseline), those within `close` of each other on one line."""
  groups: list[tuple[float, list[str]]] = []
  for point in sorted(PAPER_POINTS[1:], key=lambda p: p.realized_speedup):
    if groups and point.realized_speedup - groups[-1][0] <= close:
      groups[-1][1].append(f"{point.label} {point.realized_speedup:.2f}x")
    else:
      groups.append((point.realized_speedup, [f"{point.label} {point.realized_speedup:.2f}x"]))
  return groups


def per_prompt(results: dict, name: str) -> tuple[list[float], list[float]]:
  xs, ys = [], []
  for prompt in results["prompts"]:
    run = prompt["runs"][name]
    x, y = run["realized_speedup"], run["theoretical_speedup"]
    if defined(x) and defined(y):
      xs.append(x)
      ys.append(y)
  return xs, ys
