"""`results.json` and `report.md` of an eval run (the plot is `pareto.py`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pasta_jax.eval.pareto import write_pareto
from pasta_jax.eval.published import PAPER_POINTS

PER_PROMPT_ROWS = 50  # the report lists at most this many prompts; results.json has them all


def json_safe(value):
  """nan and inf become null (strict JSON), recursively."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [json_safe(v) for v in value]
  return value


def write_outputs(results: dict, out_dir: str | Path) -> list[Path]:
  """results.json, report.md and pareto.png in out_dir."""
  out_dir = Path(out_dir)
  return [write_results(results, out_dir / "results.json"), write_report(results, out_dir / "report.md"),
          write_pareto(json_safe(results), out_dir / "pareto.png")]


def write_results(results: dict, path: str | Path) -> Path:
  path = Path(path)
  path.write_text(json.dumps(json_safe(results), indent=1, ensure_ascii=False) + "\n")
  return path


def fmt(value, digits: int = 2, suffix: str = "") -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "n/a"
  return f"{value:.{digits}f}{suffix}"


def write_report(results: dict, path: str | Path) -> Path:
  path = Path(path)
  path.write_text("\n".join(report_lines(results)) + "\n")
  return path


def report_lines(results: dict) -> list[str]:
  settings = results.get("settings", {})
  n = results["n_prompts"]
  lines = [f"# pasta eval: {n} prompt{'s' * (n != 1)} of {settings.get('prompts', '?')}", ""]
  lines += [f"Decoding: greedy, batch 1, each prompt run twice and the second run timed; max new tokens "
            f"{settings.get('max_new_tokens', '?')}, {settings.get('lanes', '?')} lanes, chat turns "
            f"{'on' if settings.get('chat', True) else 'off'}, {settings.get('dtype', '?')}; "
            f"model {settings.get('model') or 'embedded Gemma 3 270M'}. Baseline: `{results['baseline']}`.", ""]
  lines += quality_note(results["judge"])
  lines += method_table(results)
  lines += run_totals(results)
  lines += per_prompt_table(results)
  lines += paper_table()
  return lines


def quality_note(judge: dict) -> list[str]:
  if judge["judged"]:
    text = (f"Quality: judge `{judge['name']}`, each pair shown in both orders; win rate = mean P(method beats its "
            "reference); LC = AlpacaEval's length-controlled GLM (minimal variant, `pasta_jax.eval.winrate`).")
  else:
    text = "**Quality was not judged** (speed metrics only)."
  return [text + (f" {judge['note']}" if judge.get("note") else ""), ""]


def method_table(results: dict) -> list[str]:
  return ["## Methods", "",
          "Realized speedup = reference seconds / method seconds; theoretical = reference content tokens / method "
          "critical path; parallelism = method content tokens / its critical path. geo = geometric mean (the "
          "paper's), arith = arithmetic mean.", "", *speed_table(results), ""]


def speed_table(results: dict) -> list[str]:
  """One row per method: the aggregates (also printed by `pasta eval`)."""
  lines = ["| method | vs | n | realized geo | realized arith | theoretical geo | theoretical arith | parallelism geo "
           "| parallelism arith | win rate | LC win rate |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for m in results["methods"]:
    if m["role"] != "method":
      continue
    s = m["speed"]
    q = m.get("quality") or {}
    lc = fmt(q.get("lc_win_rate"), 1, "%") if q else "not judged"
    if q and q.get("lc_note"):
      lc += f" ({q['lc_note']})"
    lines.append(f"| `{m['name']}` | `{m['reference']}` | {s['realized_speedup']['n']} | "
                 f"{fmt(s['realized_speedup']['geometric'])} | {fmt(s['realized_speedup']['arithmetic'])} | "
                 f"{fmt(s['theoretical_speedup']['geometric'])} | {fmt(s['theoretical_speedup']['arithmetic'])} | "
                 f"{fmt(s['parallelism']['geometric'])} | {fmt(s['parallelism']['arithmetic'])} | "
                 f"{fmt(q.get('win_rate'), 1, '%') if q else 'not judged'} | {lc} |")
  return lines


def run_totals(results: dict) -> list[str]:
  lines = ["## Every decode", "",
           "| run | role | prompts | finished | with forks | content tokens | seconds | tokens/s |",
           "|---|---|---|---|---|---|---|---|"]
  for m in results["methods"]:
    t = m["totals"]
    lines.append(f"| `{m['name']}` | {m['role']} | {t['n']} | {t['finished']} | {t['with_forks']} | "
                 f"{t['content_tokens']} | {fmt(t['seconds'], 1)} | {fmt(t['tokens_per_second'], 1)} |")
  lines.append("")
  if any(m["role"] == "baseline" and m["totals"]["with_forks"] for m in results["methods"]):
    lines += ["Note: the baseline forked on some prompts (its model emitted PASTA tags).", ""]
  return lines


def per_prompt_table(results: dict) -> list[str]:
  methods = [m["name"] for m in results["methods"] if m["role"] == "method"]
  if not methods:
    return []
  judged = results["judge"]["judged"]
  head = " | ".join(f"`{name}` realized / theoretical{' / P(win)' * judged}" for name in methods)
  lines = ["## Per prompt", "", f"| id | tokens | {head} | note |", "|---|---|" + "---|" * len(methods) + "---|"]
  for prompt in results["prompts"][:PER_PROMPT_ROWS]:
    cells, notes = [], []
    for name in methods:
      run = prompt["runs"][name]
      cell = f"{fmt(run['realized_speedup'])} / {fmt(run['theoretical_speedup'])}"
      cells.append(cell + (f" / {fmt(run['p_win'])}" if judged else ""))
      if run.get("note"):
        notes.append(run["note"])
    tokens = prompt["runs"][methods[0]]["content_tokens"]
    lines.append(f"| {prompt['id']} | {tokens} | {' | '.join(cells)} | {'; '.join(notes)} |")
  if len(results["prompts"]) > PER_PROMPT_ROWS:
    lines.append(f"\n({len(results['prompts']) - PER_PROMPT_ROWS} more prompts in results.json)")
  return lines + [""]


def paper_table() -> list[str]:
  lines = ["## Published reference (PASTA paper, section 5.2)", "",
           "Gemma 7B on H100, 805 AlpacaEval prompts, LC win rate against Baseline-SFT judged by GPT-4.", "",
           "| model | realized speedup (geo) | LC win rate | where |", "|---|---|---|---|"]
  for p in PAPER_POINTS:
    lines.append(f"| {p.label} | {p.realized_speedup:.2f} | {p.lc_win_rate:.1f}% | {p.source} |")
  return lines + ["", "Pasta-BoN-4 and -8 appear only in the paper's figures; SoT on Baseline-SFT gave no speedup "
                      "(no win rate stated)."]
