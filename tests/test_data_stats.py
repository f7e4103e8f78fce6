"""Dataset statistics on a tiny hand-made annotated set, every expected value worked out by hand.

The character tokenizer gives one token per character (topics too), so every count below can be
read off the strings. Critical path per `lang.metrics`: main feeds one token per step; a promise's
LENGTH token fed at step t spawns its fork (`<async>` at t, content j at t + j, closing at
t + n + 1); `<sync/>` feeds at max(its own turn, the forks' closing steps); the answer ends at the
last feed.
"""

from __future__ import annotations

import json
import math

import pytest

from pasta_jax.commands.data_stats import run_stats
from pasta_jax.data.stats import answer_shape, dataset_stats, markdown_summary, write_histogram
from pasta_jax.decode.api import LangTokenizer
from tests.tiny import CharTokenizer

TOKENIZER = CharTokenizer()

# A: main "Go:" steps 1-3; promise 1 = PROMISE 4, "a" 5, LENGTH 6 -> fork 1 closes at 6 + 3 + 1 = 10;
#    promise 2 = PROMISE 7, "b" 8, LENGTH 9 -> fork 2 closes at 9 + 2 + 1 = 12; <sync/> at max(10, 10, 12) = 12;
#    "ok" 13, 14. Critical path 14; content "Go:" + "xyz" + "pq" + "ok" = 10 tokens; tag-free "Go:xyzpqok" = 10.
ANSWER_A = 'Go:<promise topic="a" tokens="10"/><async>xyz</async><promise topic="b" tokens="10"/><async>pq</async>' \
           '<sync/>ok'
# B: "A" 1; PROMISE 2, "t" 3, LENGTH 4 -> closes at 4 + 8 + 1 = 13; PROMISE 5, "u" 6, LENGTH 7 -> closes at
#    7 + 6 + 1 = 14; <sync/> at max(8, 13, 14) = 14; "Z" 15. Critical path 15; content 1 + 8 + 6 + 1 = 16 = tag-free.
ANSWER_B = 'A<promise topic="t" tokens="10"/><async>abcdefgh</async><promise topic="u" tokens="10"/>' \
           '<async>ijklmn</async><sync/>Z'

RECORDS = [
    {"id": "a", "instruction": "q", "input": "", "output": "-", "annotated": ANSWER_A},
    {"id": "b", "instruction": "q", "input": "", "output": "-", "annotated": ANSWER_B},
    {"id": "plain", "instruction": "q", "input": "", "output": "no annotation"},
    {"id": "broken", "instruction": "q", "input": "", "output": "-", "annotated": "x</async>"},
]


def test_answer_shape_by_hand():
  shape = answer_shape(ANSWER_A, LangTokenizer(TOKENIZER), TOKENIZER.tag_vocab())
  assert shape.block_tokens == (3, 2)
  assert (shape.critical_path, shape.content_tokens, shape.baseline_tokens) == (14, 10, 10)
  assert shape.theoretical_parallelism == shape.theoretical_speedup == 10 / 14


def test_dataset_stats_by_hand():
  stats = dataset_stats(RECORDS, TOKENIZER, "tiny")
  assert (stats.records, stats.annotated, stats.invalid_annotations) == (4, 2, 1)
  assert stats.annotated_share == 0.5
  assert (stats.blocks_mean, stats.blocks_median) == (2, 2)
  # Block lengths 3, 2, 8, 6 -> sorted 2, 3, 6, 8: mean 19 / 4, median (3 + 6) / 2,
  # p90 at rank 0.9 * 3 = 2.7 between 6 and 8: 6 + 0.7 * 2.
  assert stats.block_tokens_mean == 19 / 4
  assert stats.block_tokens_median == 4.5
  assert stats.block_tokens_p90 == pytest.approx(7.4)
  speedups = [10 / 14, 16 / 15]
  assert stats.speedup_geomean == pytest.approx(math.sqrt(speedups[0] * speedups[1]))
  assert stats.speedup_mean == pytest.approx(sum(speedups) / 2)
  assert stats.parallelism_geomean == pytest.approx(stats.speedup_geomean)  # tag-free = content here
  assert stats.parallelism == pytest.approx(tuple(speedups))


def test_speedup_and_parallelism_differ_when_tokenization_does():
  class PairTokenizer(CharTokenizer):
    """'ab' is one token when tokenized as one text; split at a block edge it is two."""

    def encode(self, text, add_bos=True):
      ids, i = [], 0
      while i < len(text):
        ids.append(1000 if text.startswith("ab", i) else 100 + ord(text[i]))
        i += 2 if text.startswith("ab", i) else 1
      return ([2] if add_bos else []) + ids

  answer = 'a<promise topic="t" tokens="10"/><async>b</async>'  # tag-free "ab": 1 token; content: 2
  shape = answer_shape(answer, LangTokenizer(PairTokenizer()), TOKENIZER.tag_vocab())
  # "a" 1; PROMISE 2, "t" 3, LENGTH 4 -> fork closes at 4 + 1 + 1 = 6; main ends at 4: critical path 6.
  assert (shape.critical_path, shape.content_tokens, shape.baseline_tokens) == (6, 2, 1)
  assert (shape.theoretical_parallelism, shape.theoretical_speedup) == (2 / 6, 1 / 6)


def test_no_annotations():
  stats = dataset_stats(RECORDS[2:3], TOKENIZER, "none")
  assert (stats.records, stats.annotated, stats.annotated_share) == (1, 0, 0.0)
  assert math.isnan(stats.blocks_mean) and math.isnan(stats.parallelism_geomean)


def test_histogram_and_markdown(tmp_path):
  stats = dataset_stats(RECORDS, TOKENIZER, "tiny")
  png = write_histogram(stats, tmp_path / "sub" / "hist.png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
  empty = write_histogram(dataset_stats([], TOKENIZER, "empty"), tmp_path / "empty.png")
  assert empty.stat().st_size > 1000
  text = markdown_summary([stats])
  assert "| | tiny |" in text
  assert "| annotated | 2 (50.0%) |" in text
  assert "| block length in tokens, mean / median / p90 | 4.8 / 4.5 / 7.4 |" in text
  assert f"| theoretical speedup, geometric / arithmetic mean | {stats.speedup_geomean:.3f} / " in text


def test_run_stats_writes_the_report(tmp_path):
  path = tmp_path / "pool.jsonl"
  rows = [{"id": 1, "instruction": "List", "output": "Two:\n- first item\n- second one\n\nDone."},
          {"id": 2, "instruction": "Say", "output": "Nothing to split."}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  stats = run_stats(path, tmp_path / "out", tokenizer=TOKENIZER, progress=False)
  assert (stats.name, stats.records, stats.annotated, stats.blocks_mean) == ("pool", 2, 1, 2)
  for name in ("pool_stats.md", "pool_stats.json", "pool_parallelism.png"):
    assert (tmp_path / "out" / name).stat().st_size > 0
  summary = json.loads((tmp_path / "out" / "pool_stats.json").read_text())
  assert summary["annotated_share"] == 0.5 and "parallelism" not in summary
  kept = run_stats(path, tmp_path / "kept", annotator="none", tokenizer=TOKENIZER, progress=False)
  assert kept.annotated == 0
  assert json.loads((tmp_path / "kept" / "pool_stats.json").read_text())["blocks_mean"] is None  # nan -> null
