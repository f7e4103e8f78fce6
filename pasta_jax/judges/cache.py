"""A resumable judge: every verdict is appended to a JSONL file as soon as it is made, keyed by the
judge and the exact ordered pair, so an interrupted run never judges the same pair twice."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from pasta_jax import runfiles
from pasta_jax.judges.base import Judge, Verdict


def pair_key(judge_name: str, instruction: str, first: str, second: str) -> str:
  payload = json.dumps([judge_name, instruction, first, second], ensure_ascii=False)
  return hashlib.sha256(payload.encode()).hexdigest()


class CachedJudge:
  def __init__(self, inner: Judge, path: str | Path):
    self.inner, self.path, self.name = inner, Path(path), inner.name
    self._lock = threading.Lock()
    self._seen = {row["key"]: Verdict(row["p_first"], row.get("raw", "")) for row in runfiles.read_rows(self.path)
                  if "key" in row}
    self.hits = self.misses = 0

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    key = pair_key(self.name, instruction, first, second)
    with self._lock:
      if key in self._seen:
        self.hits += 1
        return self._seen[key]
    verdict = self.inner.compare(instruction, first, second)
    with self._lock:
      self.misses += 1
      self._seen[key] = verdict
      runfiles.append_row(self.path, {"key": key, "judge": self.name, "p_first": verdict.p_first,
                                      "raw": verdict.raw[:500]})
    return verdict
