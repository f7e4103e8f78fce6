"""`pasta data-stats`: annotate a dataset (or take its annotations) and report its shape and promised parallelism."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pasta_jax.errors import ConfigError

if TYPE_CHECKING:
  from pasta_jax.data.stats import DatasetStats

KEEP_ANNOTATIONS = "none"


def load_tokenizer(tokenizer=None):
  """A tokenizer object as is; a path (.gguf or HF folder) loaded; None: the embedded Gemma 3 270M's."""
  from pasta_jax.model.tokenizer import Tokenizer
  if tokenizer is None:
    from pasta_jax.model.load import embedded_gguf_path
    return Tokenizer.from_gguf(embedded_gguf_path())  # the tokenizer alone: no weights to dequantize
  if isinstance(tokenizer, str | os.PathLike):
    return Tokenizer.load(tokenizer)
  return tokenizer


def run_stats(path_or_name: str | os.PathLike, out_dir: str | os.PathLike, *, annotator: str = "structural",
              tokenizer=None, max_records: int | None = None, progress: bool = True) -> DatasetStats:
  """Writes <name>_stats.md, <name>_stats.json and <name>_parallelism.png to out_dir; returns the stats.

  path_or_name: a shared dataset name (lima, alpaca_gpt4_1k, alpaca_5k, alpaca_eval_805, mt_bench) or a
  JSONL path. annotator: "structural" annotates every record's `output` (replacing the file's
  annotations); "none" measures the annotations the file already has.
  """
  # imported here, not at the top: `pasta` builds this command's parser for every command (grain takes 0.4 s)
  from pasta_jax.data import sources
  from pasta_jax.data.pipeline import ANNOTATORS, annotate_records
  from pasta_jax.data.stats import dataset_stats, write_report
  if annotator not in (*ANNOTATORS, KEEP_ANNOTATIONS):
    raise ConfigError(f"unknown annotator {annotator!r}; use one of: {', '.join((*ANNOTATORS, KEEP_ANNOTATIONS))}")
  records = sources.read_records(path_or_name, max_records)
  tokenizer = load_tokenizer(tokenizer)
  if annotator != KEEP_ANNOTATIONS:
    records = annotate_records(records, tokenizer, annotator, progress=progress)
  stats = dataset_stats(records, tokenizer, sources.dataset_name(path_or_name), progress=progress)
  write_report(stats, out_dir)
  return stats


def add_stats_parser(subparsers) -> None:
  parser = subparsers.add_parser("data-stats", help="annotate a dataset and report its shape and parallelism")
  parser.add_argument("data", help="lima, alpaca_gpt4_1k, alpaca_5k, alpaca_eval_805, mt_bench or a JSONL path")
  parser.add_argument("--out", required=True, help="folder for <name>_stats.md/.json and <name>_parallelism.png")
  parser.add_argument("--annotator", default="structural",
                      help=f"structural (default), or {KEEP_ANNOTATIONS} to measure the file's own `annotated`")
  parser.add_argument("--limit", type=int, default=None)


def run_stats_command(args) -> int:
  from pasta_jax.data.stats import markdown_summary
  stats = run_stats(args.data, args.out, annotator=args.annotator, max_records=args.limit)
  print(markdown_summary([stats]))
  print(f"report, JSON and parallelism plot in {args.out}")
  return 0
