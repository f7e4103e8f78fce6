"""The resumable judge cache: a run killed mid-way and run again never asks the inner judge about
the same ordered pair twice, and gives the same verdicts as a run that was never interrupted."""

from __future__ import annotations

import threading
import time

import pytest

from pasta_jax.judges import CachedJudge, Verdict, judge_both_orders
from pasta_jax.judges.cache import RAW_CHARS, pair_key
from pasta_jax.model.runfiles import read_rows

PAIRS = [("q1", "a", "b"), ("q1", "b", "a"), ("q2", "x", "y"), ("q3", "long answer", "short"), ("q4", "ü", "€")]


class Counting:
  """An inner judge that counts its calls and, like a killed run, stops after `fail_after` of them."""

  name = "counting"

  def __init__(self, fail_after=None, delay=0.0):
    self.calls, self.fail_after, self.delay, self.lock = [], fail_after, delay, threading.Lock()

  def compare(self, instruction, first, second):
    with self.lock:
      if self.fail_after is not None and len(self.calls) >= self.fail_after:
        raise KeyboardInterrupt("killed")
      self.calls.append((instruction, first, second))
    time.sleep(self.delay)
    return Verdict(len(first) / (len(first) + len(second)), f"raw {first}")


def uninterrupted(pairs):
  judge = Counting()
  return [judge.compare(*p).p_first for p in pairs]


@pytest.mark.parametrize("killed_after", [0, 1, 3])
def test_interrupted_run_resumes_without_judging_twice(tmp_path, killed_after):
  path = tmp_path / "verdicts.jsonl"
  first = Counting(fail_after=killed_after)
  judge = CachedJudge(first, path)
  with pytest.raises(KeyboardInterrupt):
    for pair in PAIRS:
      judge.compare(*pair)
  with open(path, "a") as f:
    f.write('{"key": "half-writ')  # the kill cut a line in half
  second = Counting()
  resumed = CachedJudge(second, path)
  assert len(resumed) == killed_after
  got = [resumed.compare(*pair).p_first for pair in PAIRS]
  assert got == uninterrupted(PAIRS)
  assert not set(first.calls) & set(second.calls) and len(first.calls) + len(second.calls) == len(PAIRS)
  assert (resumed.hits, resumed.misses) == (killed_after, len(PAIRS) - killed_after)
  again = Counting()
  assert [CachedJudge(again, path).compare(*p).p_first for p in PAIRS] == got and again.calls == []
  assert len(list(read_rows(path))) == len(PAIRS)  # the half line was skipped, every pair written once


def test_both_orders_are_two_cached_pairs(tmp_path):
  inner = Counting()
  judge = CachedJudge(inner, tmp_path / "v.jsonl")
  p = judge_both_orders(judge, "q", "apple", "fig")
  assert p == judge_both_orders(judge, "q", "apple", "fig") and len(inner.calls) == 2
  assert judge.hits == 2 and judge.misses == 2


def test_a_different_judge_does_not_reuse_verdicts(tmp_path):
  CachedJudge(Counting(), tmp_path / "v.jsonl").compare(*PAIRS[0])
  other = Counting()
  other.name = "another"
  cached = CachedJudge(other, tmp_path / "v.jsonl")
  cached.compare(*PAIRS[0])
  assert len(other.calls) == 1 and cached.name == "another"
  assert pair_key("a", "q", "x", "y") != pair_key("a", "q", "y", "x") != pair_key("b", "q", "y", "x")


def test_fresh_and_cached_verdicts_are_identical(tmp_path):
  class Wordy(Counting):
    def compare(self, instruction, first, second):
      return Verdict(0.25, "x" * (3 * RAW_CHARS))

  fresh = CachedJudge(Wordy(), tmp_path / "deep" / "v.jsonl").compare("q", "a", "b")  # parent folder made
  cached = CachedJudge(Wordy(fail_after=0), tmp_path / "deep" / "v.jsonl").compare("q", "a", "b")
  assert fresh == cached and len(fresh.raw) == RAW_CHARS


def test_rows_of_another_shape_are_skipped(tmp_path):
  path = tmp_path / "v.jsonl"
  path.write_text('{"key": "k1"}\n[1, 2]\n{"key": "k2", "p_first": "nan?"}\nnot json\n')
  inner = Counting()
  assert CachedJudge(inner, path).compare("q", "a", "b").p_first == 0.5 and len(inner.calls) == 1


def test_concurrent_callers_judge_a_pair_once(tmp_path):
  inner = Counting(delay=0.05)
  judge = CachedJudge(inner, tmp_path / "v.jsonl")
  results = []
  threads = [threading.Thread(target=lambda: results.append(judge.compare("q", "a", "bb").p_first))
             for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == [pytest.approx(1 / 3)] * 6 and len(inner.calls) == 1
  assert (judge.hits, judge.misses) == (5, 1)


def test_a_failed_judgement_is_not_cached(tmp_path):
  judge = CachedJudge(Counting(fail_after=0), tmp_path / "v.jsonl")
  with pytest.raises(KeyboardInterrupt):
    judge.compare("q", "a", "b")
  inner = Counting()
  judge.inner = inner  # the same cache object, a working judge: the pair is judged, not stuck pending
  assert judge.compare("q", "a", "b").p_first == 0.5 and len(inner.calls) == 1
