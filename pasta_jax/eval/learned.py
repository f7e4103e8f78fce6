"""What a trained PASTA model does on its own, in free decoding, against Baseline-SFT.

From `evaluate`'s results (a `pasta` method measured against a `sequential` baseline, both free):
  fork rate            answers with at least one fork
  well-formed          answers whose promise-form text parses strictly (tags balanced, lengths valid);
                       an answer cut off by the token budget is judged on what it wrote before the
                       cut (a block left open by the cut is closed first: the budget cut it, not the model)
  truncated            answers cut off by the token budget (no end token)
  duplicate-block rate sibling-block pairs with word 4-gram overlap > 0.5, over all pairs of all answers
  repeated list items  the same rule over the sibling list items of the clean answer, for both models: a
                       small model repeats itself in plain lists too, so this says how much of the
                       duplicate-block rate is forking and how much is the model
  misnumbered lists    answers with a numbered list whose numbers do not run on by one (1, 2, 2, 3 or 1, 3, 4),
                       over the answers with a numbered list: main numbers the forked groups from their topics,
                       and a model that loses count writes this
  list rate            answers whose clean text holds a list of 2+ items: the structural annotator forks
                       only list items, so Baseline-SFT's list rate bounds what this recipe's fork rate can be
  ROUGE-L              against the prompt's reference answer, for both models
  log-likelihood       mean per-token log p of each model's clean answer under the scoring model
                       (Baseline-SFT), when a scorer is given; and of the prompt's reference answer, as an
                       anchor: Baseline-SFT's own greedy answers are its mode, which any other text, a good
                       one too, scores below
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from pasta_jax.data.structural import split_items
from pasta_jax.data.structural_grouped import NUMBER, list_runs
from pasta_jax.lang import metrics
from pasta_jax.lang.metrics import arithmetic_mean, rouge_l
from pasta_jax.lang.tags import LENGTH_STEP

blocks_of = metrics.block_texts


def _closed_at_cut(annotated: str) -> str:
  """A cut-off answer with the block the cut left open closed (`Result.annotated` closes every fork a cut
  left open, in place, since its renderer reads the records; answers stored before that may still end in
  one). Nothing else is repaired."""
  last_open, last_close = annotated.rfind("<async>"), annotated.rfind("</async>")
  return annotated + "</async>" if last_open > last_close else annotated


def numbered_lists(text: str) -> list[list[int]]:
  """The numbers of each numbered list of 2+ items in `text`, in order."""
  pieces = split_items(text)
  numbers = [[int(m.group(1)) for i in run if (m := NUMBER.match(pieces[i][1]))] for run in list_runs(pieces)]
  return [run for run in numbers if len(run) >= 2]


def misnumbered(text: str) -> bool:
  return any(b != a + 1 for run in numbered_lists(text) for a, b in zip(run, run[1:]))


def answer_figures(run: Mapping, reference: str, length_step: int = LENGTH_STEP) -> dict:
  """Per-answer figures of one run (a `MethodOutput` as a dict); its tags parse with promise lengths in multiples of
  `length_step` (the writer's position mode, `schema.length_step`)."""
  annotated = run["annotated"] if run["finished"] else _closed_at_cut(run["annotated"])
  blocks = blocks_of(annotated, length_step)
  dupes, pairs = metrics.duplicate_block_pairs(blocks or [])
  items = [chunk for kind, chunk in split_items(run["text"]) if kind == "item"]
  item_dupes, item_pairs = metrics.duplicate_block_pairs(items)
  return dict(forks=run["threads"] - 1, well_formed=blocks is not None, truncated=not run["finished"],
              refusals=run.get("refusals", 0),  # a run decoded before they were kept counts none
              duplicate_pairs=dupes, sibling_pairs=pairs, repeated_item_pairs=item_dupes, item_pairs=item_pairs,
              has_list=len(items) >= 2, numbered=bool(numbered_lists(run["text"])),
              misnumbered=misnumbered(run["text"]),
              rouge_l=rouge_l(run["text"], reference) if reference else math.nan)


def learned_figures(results: Mapping, records: Sequence[Mapping], method: str, baseline: str,
                    scorer: Callable[[str, str], float] | None = None, length_step: int = LENGTH_STEP) -> dict:
  """Aggregates for `method` (the PASTA model) and `baseline` over every prompt of `results`. length_step: the
  granularity of the method's promise lengths (1 for a Pred-1x model: its exact lengths are well-formed)."""
  by_id = {r["id"]: r for r in records}
  rows = {name: [] for name in (method, baseline)}
  reference_logprobs = []
  for prompt in results["prompts"]:
    record = by_id[prompt["id"]]
    reference = record.get("reference") or record.get("output") or ""
    if scorer is not None and reference:
      reference_logprobs.append(scorer(prompt["instruction"], reference))
    for name in rows:
      run = prompt["runs"][name]
      figures = answer_figures(run, reference, length_step if name == method else LENGTH_STEP)
      if scorer is not None:
        figures["logprob"] = scorer(prompt["instruction"], run["text"])
      rows[name].append(figures)
  summary = next(m for m in results["methods"] if m["name"] == method)
  speed = summary["speed"]
  out = dict(n=len(results["prompts"]), realized=speed["realized_speedup"]["geometric"],
             realized_arithmetic=speed["realized_speedup"]["arithmetic"],
             theoretical=speed["theoretical_speedup"]["geometric"], parallelism=speed["parallelism"]["geometric"])
  out["realized_over_theoretical"] = out["realized"] / out["theoretical"] if out["theoretical"] else math.nan
  for name, label in ((method, "pasta"), (baseline, "baseline")):
    out[label] = _aggregate(rows[name])
  if reference_logprobs:
    out["reference"] = dict(logprob=arithmetic_mean(reference_logprobs), n=len(reference_logprobs))
  return out


def _aggregate(rows: Sequence[Mapping]) -> dict:
  n = max(len(rows), 1)
  pairs = sum(r["sibling_pairs"] for r in rows)
  item_pairs = sum(r["item_pairs"] for r in rows)
  agg = dict(fork_rate=sum(r["forks"] > 0 for r in rows) / n, list_rate=sum(r["has_list"] for r in rows) / n,
             well_formed=sum(r["well_formed"] for r in rows) / n,
             truncated=sum(r["truncated"] for r in rows) / n,
             refusals=sum(r["refusals"] for r in rows),
             duplicate_rate=sum(r["duplicate_pairs"] for r in rows) / pairs if pairs else 0.0,
             sibling_pairs=pairs,
             misnumbered=sum(r["misnumbered"] for r in rows) / max(sum(r["numbered"] for r in rows), 1),
             repeated_items=sum(r["repeated_item_pairs"] for r in rows) / item_pairs if item_pairs else 0.0,
             rouge_l=arithmetic_mean(r["rouge_l"] for r in rows if math.isfinite(r["rouge_l"])))
  if rows and "logprob" in rows[0]:
    agg["logprob"] = arithmetic_mean(r["logprob"] for r in rows)
  return agg


def result_line(figures: Mapping) -> str:
  p = figures["pasta"]
  return (f"RESULT realized={figures['realized']:.3f} theoretical={figures['theoretical']:.3f} "
          f"fork_rate={p['fork_rate']:.3f} well_formed={p['well_formed']:.3f} duplicate_rate={p['duplicate_rate']:.3f}")


def figure_lines(figures: Mapping) -> list[str]:
  """A markdown table: the PASTA model beside Baseline-SFT."""
  p, b = figures["pasta"], figures["baseline"]
  rows = [("fork rate", "fork_rate", 3), ("answers with a list (2+ items)", "list_rate", 3),
          ("well-formed tags", "well_formed", 3), ("truncated", "truncated", 3),
          ("topics cut at their cap (all answers)", "refusals", 0), ("duplicate-block rate", "duplicate_rate", 3),
          ("repeated list items (clean text)", "repeated_items", 3),
          ("misnumbered lists (of answers with a numbered list)", "misnumbered", 3),
          ("ROUGE-L vs reference", "rouge_l", 4),
          (f"log p per token under {figures.get('scorer', 'Baseline-SFT')}", "logprob", 4)]
  lines = [f"Prompts: {figures['n']}. Realized speedup (geo) {figures['realized']:.3f} "
           f"(arithmetic {figures['realized_arithmetic']:.3f}), theoretical {figures['theoretical']:.3f}, "
           f"realized/theoretical {figures['realized_over_theoretical']:.3f}.", "",
           "| figure | PASTA model | Baseline-SFT | reference answers |", "|---|---|---|---|"]
  reference = figures.get("reference", {})
  for label, key, digits in rows:
    if key in p:
      anchor = f"{reference[key]:.{digits}f}" if key in reference else "-"
      lines.append(f"| {label} | {p[key]:.{digits}f} | {b[key]:.{digits}f} | {anchor} |")
  return lines
