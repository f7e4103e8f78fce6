"""What a step of k rows cost in a finished `bench.learned` / `pasta eval` run: least squares over its answers.

Realized speedup falls short of theoretical where a step that feeds several threads costs more than a one-row
step. This reads a run folder's timed answers (`partial.jsonl`: each answer's seconds and promise-form text),
counts each answer's steps by rows a step under unlimited lanes (`lang.metrics.feed_steps`), and fits
seconds = fixed + sum over buckets of cost x steps, with the baseline's one-row steps a bucket of their own. No
model runs; the tokenizer is the embedded one's.

  python -m bench.step_buckets [--run runs/learned]
Last line: RESULT one_row_ms=... two_rows_over_one=... three_four_over_one=...
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from bench.common import table
from pasta_jax.errors import TagError
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.metrics import feed_steps

BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8))  # rows a step, as the interpreter's lane buckets group them


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.step_buckets", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", default="runs/learned", help="a bench.learned / pasta eval run folder")
  return parser.parse_args(argv)


def step_counts(annotated: str, lang, vocab) -> list[int]:
  """Steps of each bucket's row counts an answer takes under unlimited lanes."""
  steps, _ = feed_steps(tok.encode_answer(annotated, lang, vocab), vocab)
  rows = Counter(steps).values()  # tokens fed at each step
  return [sum(lo <= n <= hi for n in rows) for lo, hi in BUCKETS]


def parsed_answers(runs: list[dict], lang, vocab) -> tuple[list[tuple[bool, list[int], float]], int]:
  """A run's rows -> (is_baseline, bucket step counts, seconds) for each answer whose tags parse, and how many did
  not (a malformed answer's steps cannot be counted from its text: it is left out of the fit, and counted)."""
  answers, malformed = [], 0
  for r in runs:
    try:
      counts = step_counts(r["output"]["annotated"], lang, vocab)
    except TagError:
      malformed += 1
      continue
    answers.append((r["method"].startswith("sequential"), counts, r["output"]["seconds"]))
  return answers, malformed


def fit(answers: list[tuple[bool, list[int], float]]) -> tuple[float, np.ndarray, np.ndarray]:
  """answers: (is_baseline, bucket step counts, seconds) -> (fixed seconds, costs [1 + len(BUCKETS)], steps)."""
  design = np.asarray([[1.0, counts[0] if base else 0, 0 if base else counts[0], *counts[1:]]
                       for base, counts, _ in answers])
  seconds = np.asarray([s for *_, s in answers])
  coef = np.linalg.lstsq(design, seconds, rcond=None)[0]
  return float(coef[0]), coef[1:], design[:, 1:].sum(axis=0)


def main(argv=None) -> int:
  from pasta_jax.decode.api import LangTokenizer
  from pasta_jax.model.load import load_model

  args = parse_args(argv)
  path = Path(args.run) / "partial.jsonl"
  if not path.is_file():
    raise SystemExit(f"bench.step_buckets: {path} not found (run bench.learned or pasta eval with --out first)")
  model = load_model("base")
  lang, vocab = LangTokenizer(model.tokenizer), model.tokenizer.tag_vocab()
  runs = [json.loads(line) for line in path.open()]
  answers, malformed = parsed_answers(runs, lang, vocab)
  fixed, costs, steps = fit(answers)
  names = ["baseline, 1 row", "method, 1 row", "method, 2 rows", "method, 3-4 rows", "method, 5-8 rows"]
  rows = [{"steps of": n, "ms a step": 1e3 * c, "vs baseline 1 row": c / costs[0], "steps": int(s)}
          for n, c, s in zip(names, costs, steps)]
  print(f"{len(answers)} answers from {path} ({malformed} left out: tags that do not parse); "
        f"fixed {1e3 * fixed:.0f} ms an answer")
  print(table(rows, tuple(rows[0])))
  print(f"RESULT one_row_ms={1e3 * costs[0]:.1f} two_rows_over_one={costs[2] / costs[0]:.3f} "
        f"three_four_over_one={costs[3] / costs[0]:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
