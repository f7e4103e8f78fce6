"""Shape of an annotated instruction dataset: how much of it is annotated, how its blocks look, and
how much parallelism its annotations promise (DESIGN section 7's theoretical metrics).

Per dataset, over the records that carry an `annotated` answer that parses (an annotation that does
not parse is counted in `invalid_annotations` and left out of everything else):
  annotated share        annotated records / all records
  blocks per answer      mean and median over annotated answers (an answer with none counts 0)
  block length           content tokens of a block (no `<async>` / `</async>`), mean, median, p90
                         (numpy's linear-interpolation percentile) over every block of every answer
  theoretical speedup    baseline tokens / critical path, the baseline being the tag-free answer
                         (`strip_tags`) tokenized as one text: what sequential decoding of the very
                         same answer takes
  theoretical parallelism  content tokens / critical path (`lang.metrics`)
The two ratios differ only by how the answer splits into tokens at block edges. Both are aggregated
with the geometric mean (the papers' choice) and the arithmetic mean.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pasta_jax.decode.api import LangTokenizer
from pasta_jax.errors import TagError
from pasta_jax.lang.metrics import answer_metrics, arithmetic_mean, geometric_mean
from pasta_jax.lang.tags import TagVocab
from pasta_jax.lang.text import strip_tags
from pasta_jax.lang.tokens import TokBlock, encode_answer, parse_tokens, split_end


@dataclasses.dataclass(frozen=True)
class AnswerShape:
  """One annotated answer, measured."""

  block_tokens: tuple[int, ...]  # content tokens of each block, in order
  critical_path: int  # decode steps with unlimited lanes (lang.metrics)
  content_tokens: int  # main text + block contents
  baseline_tokens: int  # the tag-free answer tokenized as one text

  @property
  def num_blocks(self) -> int:
    return len(self.block_tokens)

  @property
  def theoretical_speedup(self) -> float:
    return self.baseline_tokens / max(self.critical_path, 1)

  @property
  def theoretical_parallelism(self) -> float:
    return self.content_tokens / max(self.critical_path, 1)


def answer_shape(annotated: str, lang: LangTokenizer, vocab: TagVocab) -> AnswerShape:
  """Measures one promise-form answer. Raises TagError if it does not parse."""
  answer, _ = split_end(encode_answer(annotated, lang, vocab), vocab)
  blocks = tuple(len(s.content) for s in parse_tokens(answer, vocab) if isinstance(s, TokBlock))
  metrics = answer_metrics(answer, vocab)
  return AnswerShape(block_tokens=blocks, critical_path=metrics.critical_path, content_tokens=metrics.content_tokens,
                     baseline_tokens=len(lang.encode(strip_tags(annotated))))


@dataclasses.dataclass(frozen=True)
class DatasetStats:
  name: str
  records: int
  annotated: int  # records with an annotation that parses
  invalid_annotations: int  # records whose annotation does not parse (left out of the rest)
  blocks_mean: float
  blocks_median: float
  block_tokens_mean: float
  block_tokens_median: float
  block_tokens_p90: float
  speedup_geomean: float
  speedup_mean: float
  parallelism_geomean: float
  parallelism_mean: float
  parallelism: tuple[float, ...]  # per annotated answer, for the histogram

  @property
  def annotated_share(self) -> float:
    return self.annotated / self.records if self.records else math.nan

  def summary(self) -> dict[str, Any]:
    """Every figure but the per-answer list (JSON-ready)."""
    out = {k: v for k, v in dataclasses.asdict(self).items() if k != "parallelism"}
    return {**out, "annotated_share": self.annotated_share}


def dataset_stats(records: Sequence[Mapping[str, Any]], tokenizer, name: str = "dataset", *,
                  progress: bool = False) -> DatasetStats:
  """Measures every record's `annotated` answer (records without one count only in `records`)."""
  lang, vocab = LangTokenizer(tokenizer), tokenizer.tag_vocab()
  shapes, invalid = [], 0
  for record in tqdm(records, desc=f"measuring {name}", disable=not progress, leave=False):
    if not record.get("annotated"):
      continue
    try:
      shapes.append(answer_shape(record["annotated"], lang, vocab))
    except TagError:
      invalid += 1
  return stats_from_shapes(name, len(records), shapes, invalid)


def stats_from_shapes(name: str, records: int, shapes: Sequence[AnswerShape], invalid: int = 0) -> DatasetStats:
  blocks = [s.num_blocks for s in shapes]
  block_tokens = [n for s in shapes for n in s.block_tokens]
  speedups = [s.theoretical_speedup for s in shapes]
  parallelism = [s.theoretical_parallelism for s in shapes]
  return DatasetStats(
      name=name, records=records, annotated=len(shapes), invalid_annotations=invalid,
      blocks_mean=arithmetic_mean(blocks), blocks_median=_median(blocks),
      block_tokens_mean=arithmetic_mean(block_tokens), block_tokens_median=_median(block_tokens),
      block_tokens_p90=_percentile(block_tokens, 90),
      speedup_geomean=geometric_mean(speedups), speedup_mean=arithmetic_mean(speedups),
      parallelism_geomean=geometric_mean(parallelism), parallelism_mean=arithmetic_mean(parallelism),
      parallelism=tuple(parallelism))


def _median(values: Sequence[float]) -> float:
  return float(np.median(values)) if len(values) else math.nan


def _percentile(values: Sequence[float], q: float) -> float:
  return float(np.percentile(values, q)) if len(values) else math.nan


# --- report ------------------------------------------------------------------------------------------
ROWS = (  # (label, how to format it from the stats)
  ("records", lambda s: f"{s.records}"),
  ("annotated", lambda s: f"{s.annotated} ({_pct(s.annotated_share)})"),
  ("invalid annotations", lambda s: f"{s.invalid_annotations}"),
  ("blocks per annotated answer, mean / median", lambda s: f"{s.blocks_mean:.2f} / {s.blocks_median:g}"),
  ("block length in tokens, mean / median / p90",
   lambda s: f"{s.block_tokens_mean:.1f} / {s.block_tokens_median:g} / {s.block_tokens_p90:.1f}"),
  ("theoretical speedup, geometric / arithmetic mean", lambda s: f"{s.speedup_geomean:.3f} / {s.speedup_mean:.3f}"),
  ("theoretical parallelism, geometric / arithmetic mean",
   lambda s: f"{s.parallelism_geomean:.3f} / {s.parallelism_mean:.3f}"),
)


def _pct(share: float) -> str:
  return "n/a" if math.isnan(share) else f"{100 * share:.1f}%"


def markdown_summary(stats: Sequence[DatasetStats]) -> str:
  """One table, a column per dataset, plus the definitions the figures follow."""
  header = "| | " + " | ".join(s.name for s in stats) + " |"
  rule = "|---|" + "---|" * len(stats)
  rows = [f"| {label} | " + " | ".join(fmt(s) for s in stats) + " |" for label, fmt in ROWS]
  notes = ("Over annotated answers. Speedup = tag-free answer tokens / critical path; parallelism = content "
           "tokens / critical path; critical path = decode steps with unlimited lanes "
           "(`pasta_jax.lang.metrics`). Block length counts content tokens only.")
  return "\n".join(["# Dataset statistics", "", header, rule, *rows, "", notes, ""])


def write_histogram(stats: DatasetStats, path: str | os.PathLike) -> Path:
  """PNG histogram of the per-answer theoretical parallelism, with its geometric mean marked."""
  # Figure + the Agg canvas directly: no pyplot, so no global backend switch in the caller's process.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  values = np.asarray(stats.parallelism, float)
  if values.size:
    ax.hist(values, bins=np.histogram_bin_edges(values, bins=min(40, max(5, values.size // 5))), color="tab:blue",
            alpha=0.8)
    ax.axvline(stats.parallelism_geomean, color="tab:red", label=f"geometric mean {stats.parallelism_geomean:.3f}")
    ax.legend()
  else:
    ax.text(0.5, 0.5, "no annotated answers", ha="center", va="center", transform=ax.transAxes)
  ax.set_xlabel("theoretical parallelism (content tokens / critical path)")
  ax.set_ylabel("answers")
  ax.set_title(f"{stats.name}: {stats.annotated} annotated of {stats.records} records")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  return path


def write_report(stats: DatasetStats, out_dir: str | os.PathLike) -> dict[str, Path]:
  """<name>_stats.md, <name>_stats.json and <name>_parallelism.png in out_dir; returns their paths."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {"markdown": out / f"{stats.name}_stats.md", "json": out / f"{stats.name}_stats.json",
           "histogram": out / f"{stats.name}_parallelism.png"}
  paths["markdown"].write_text(markdown_summary([stats]) + f"\n![parallelism]({paths['histogram'].name})\n")
  summary = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in stats.summary().items()}
  paths["json"].write_text(json.dumps(summary, indent=2) + "\n")  # nan -> null: strict JSON
  write_histogram(stats, paths["histogram"])
  return paths
