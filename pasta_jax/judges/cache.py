"""A resumable judge: every verdict is appended to a JSONL file as soon as it is made, keyed by the
judge and the exact ordered pair, so an interrupted run never judges the same pair twice.

Judging is the slow, paid part of an evaluation; a run killed at pair 700 of 800 must not pay for
the first 700 again. A row cut in half by the kill is skipped on reading (runfiles.read_rows), and
that pair is simply judged again. Only verdicts with a probability in [0, 1] are written or read
back: a NaN from a misbehaving judge fails its pair instead of standing in the file for good.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path

from pasta_jax.errors import PastaError
from pasta_jax.judges.base import Judge, Verdict
from pasta_jax.model import runfiles

RAW_CHARS = 500  # enough of the judge's reply to audit it, without bloating the file


def pair_key(judge_name: str, instruction: str, first: str, second: str) -> str:
  """sha256 of the judge and the ordered pair: the same texts in the other order are another key."""
  payload = json.dumps([judge_name, instruction, first, second], ensure_ascii=False)
  return hashlib.sha256(payload.encode()).hexdigest()


class CachedJudge:
  """Wraps a judge; `hits` and `misses` count cached and fresh verdicts of this process."""

  def __init__(self, inner: Judge, path: str | Path):
    self.inner, self.path, self.name = inner, Path(path), inner.name
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._lock = threading.Lock()
    self._pending: dict[str, threading.Event] = {}  # keys being judged now: a second caller waits for them
    self._seen = dict(_cached_rows(self.path))
    self.hits = self.misses = 0

  def __len__(self) -> int:
    return len(self._seen)

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    key = pair_key(self.name, instruction, first, second)
    while True:
      with self._lock:
        if key in self._seen:
          self.hits += 1
          return self._seen[key]
        pending = self._pending.get(key)
        if pending is None:
          self._pending[key] = threading.Event()
          break
      pending.wait()  # another thread is judging this very pair; if it fails, this one tries
    try:
      fresh = self.inner.compare(instruction, first, second)
      verdict = Verdict(float(fresh.p_first), fresh.raw[:RAW_CHARS])  # as a resumed run will read it back
      if not valid_p(verdict.p_first):
        raise PastaError(f"judge {self.name} gave P(first) = {verdict.p_first!r}, not a probability; "
                         "the verdict is not cached")
      with self._lock:
        runfiles.append_row(self.path, {"key": key, "judge": self.name, "p_first": verdict.p_first,
                                        "raw": verdict.raw})
        self.misses += 1
        self._seen[key] = verdict
      return verdict
    finally:
      with self._lock:
        self._pending.pop(key).set()


def valid_p(p: float) -> bool:
  return math.isfinite(p) and 0.0 <= p <= 1.0


def _cached_rows(path: Path):
  """(key, Verdict) of the file's complete rows; rows of another shape, or with a p_first that is no
  probability (NaN, say, from an older run), are skipped, not fatal: their pairs are judged again."""
  for row in runfiles.read_rows(path):
    try:
      key, verdict = str(row["key"]), Verdict(float(row["p_first"]), str(row.get("raw", "")))
    except (KeyError, TypeError, ValueError, OverflowError):
      continue
    if valid_p(verdict.p_first):
      yield key, verdict
