"""One Pareto plot from several `bench.learned` runs: realized speedup against every quality proxy, and its table.

--speed theoretical puts the steps' speedup on the x axis instead: the wall time of runs timed on different days
carries the machine's drift between them, their step counts do not.

Each --run is one series (one colour): a run's learned.json (or its folder), and optionally, after a comma, the
learned.json of the same run read again with `--scorer base` (only the log p changes: it becomes the "log p under
the base model" panel). Every run should hold the same prompts, so the points compare: the plot's title says how
many each has, and a run of another count is refused.

  python -m bench.pareto --out docs/results/pareto/pareto.png \\
      --run "lambda sweep=runs/learned_lsweep,runs/learned_lsweep_base" \\
      --run "fork bias=runs/learned_fork_bias16,runs/learned_fork_bias16_base"

Writes the PNG and, beside it, a Markdown table of every point (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pasta_jax.eval.learned_plot import SPEEDS, plot_series

COLUMNS = (("fork rate", "fork_rate", 2), ("well-formed", "well_formed", 2), ("duplicate blocks", "duplicate_rate", 3),
           ("truncated", "truncated", 2), ("ROUGE-L", "rouge_l", 4), ("log p (scorer)", "logprob", 3),
           ("log p (base)", "logprob_base", 3))


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.pareto", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", action="append", default=[], metavar="LABEL=LEARNED[,BASE_SCORED]",
                      help="a series: a bench.learned run's learned.json (or folder), and the same run scored by "
                           "the base model")
  parser.add_argument("--out", default="runs/pareto/pareto.png", help="the PNG (the table goes beside it, .md)")
  parser.add_argument("--title", default="")
  parser.add_argument("--speed", choices=SPEEDS, default="realized",
                      help="the x axis: realized speedup (wall time), or theoretical (steps), by which runs timed "
                           "on different days still compare")
  return parser.parse_args(argv)


def _read(path: str) -> dict:
  file = Path(path)
  file = file / "learned.json" if file.is_dir() else file
  if not file.is_file():
    raise SystemExit(f"bench.pareto: no learned.json at {path}")
  return json.loads(file.read_text())


def load_series(spec: str) -> tuple[str, dict]:
  """`LABEL=LEARNED[,BASE_SCORED]` -> (label, {row: figures}), with the base model's log p as `logprob_base`."""
  label, sep, paths = spec.partition("=")
  if not sep or not paths:
    raise SystemExit(f"bench.pareto: --run wants LABEL=PATH[,PATH], got {spec!r}")
  learned, _, base_path = paths.partition(",")
  figures = _read(learned)
  if base_path:
    base = _read(base_path)
    if not set(figures) & set(base):
      raise SystemExit(f"bench.pareto: {base_path} shares no row with {learned}: not the same run read again")
    missing = sorted(set(figures) - set(base))
    if missing:  # a row decoded after the run was read again: the base model's panel goes without it
      print(f"bench.pareto: {base_path} lacks rows {missing}: their log p under the base model is left out (-)")
    for name, f in figures.items():
      for side in ("pasta", "baseline"):
        f[side]["logprob_base"] = base.get(name, {}).get(side, {}).get("logprob", math.nan)
  return label, figures


def table(series: dict[str, dict]) -> list[str]:
  head = "| series | row | fork bias | realized (geo) | theoretical (geo) | " + " | ".join(c[0] for c in COLUMNS)
  lines = [head + " |", "|---" * (5 + len(COLUMNS)) + "|"]

  def cells(values: dict) -> str:
    return " | ".join(f"{values[key]:.{digits}f}" if math.isfinite(values.get(key, math.nan)) else "-"
                      for _, key, digits in COLUMNS)

  first = next(iter(next(iter(series.values())).values()))
  lines.append(f"| Baseline-SFT | | | 1.000 | 1.000 | {cells(first['baseline'])} |")
  for label, figures in series.items():
    for name, f in figures.items():
      lines.append(f"| {label} | `{name}` | {f.get('fork_bias', 0.0):g} | {f['realized']:.3f} | "
                   f"{f['theoretical']:.3f} | {cells(f['pasta'])} |")
  return lines


def main(argv=None) -> int:
  args = parse_args(argv)
  if not args.run:
    raise SystemExit("bench.pareto: name at least one --run LABEL=LEARNED[,BASE_SCORED]")
  series = dict(load_series(spec) for spec in args.run)
  counts = {label: {f["n"] for f in figures.values()} for label, figures in series.items()}
  if len(set().union(*counts.values())) != 1:
    raise SystemExit(f"bench.pareto: the runs hold different prompt counts {counts}: their points do not compare")
  n = next(iter(next(iter(counts.values()))))
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  plot_series(series, out, args.title or f"{args.speed} speedup against each quality proxy, {n} prompts", args.speed)
  lines = [f"# The trade-off, {n} prompts", "", *table(series), ""]
  out.with_suffix(".md").write_text("\n".join(lines))
  print("\n".join(lines))
  print(f"wrote {out}, {out.with_suffix('.md')}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
