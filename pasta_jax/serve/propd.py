"""ProPD served: its step-time model T(s), measured online from the server's own chunks.

ProPD picks each step's tree size by expected accepted tokens / T(s). T depends on the device and on how
many rows a step computes, and the loop runs on device, so the engine measures it between chunks. For each
rows bucket (the power-of-two prefix of rows a chunk computes), the first chunks pin the tree size to each
candidate in turn (a latency table of 1 there and 1e9 elsewhere: the same compiled program, no recompile);
each size keeps its median per-step time (the paper's T(s) = alpha s + beta is fitted over the tree sizes and
reported: `speculation.step_times`), and from then on that bucket's chunks run with that table. A bucket's first
chunk includes its compilation and is not timed. Greedy acceptance writes plain greedy decoding's tokens at
any tree size, so calibrating costs speed, never text.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pasta_jax.decode.speculation import latency_table, step_times

PINNED_ELSEWHERE = 1e9  # the step time given to the sizes a calibration chunk must not choose


@dataclasses.dataclass
class _Bucket:
  compiled: bool = False  # its first (compiling) chunk has run
  pinned: int | None = None  # the size the chunk now running is pinned to
  times: dict = dataclasses.field(default_factory=dict)  # size -> per-step seconds measured
  fit: tuple[float, float] | None = None  # (alpha, beta) of the tree sizes
  fitted: dict | None = None  # size -> seconds per step (`speculation.step_times`' table)


class OnlineLatency:
  """T(s) per rows bucket: pinned calibration chunks first, then the measured table."""

  def __init__(self, sizes: tuple[int, ...], samples: int = 2):
    if samples < 1:
      raise ValueError(f"samples must be at least 1, got {samples}")
    self.sizes, self.samples = tuple(sizes), samples
    self.buckets: dict[int, _Bucket] = {}

  def table(self, rows: int) -> np.ndarray:
    """[n_sizes] seconds per step for the next chunk of `rows` rows: fitted, or pinned to a size to time."""
    bucket = self.buckets.setdefault(rows, _Bucket())
    if bucket.fitted is not None:
      bucket.pinned = None
      return latency_table(bucket.fitted, self.sizes)
    bucket.pinned = next(s for s in self.sizes if len(bucket.times.get(s, ())) < self.samples)
    return np.asarray([1.0 if s == bucket.pinned else PINNED_ELSEWHERE for s in self.sizes])

  def calibrating(self, rows: int) -> bool:
    """Whether chunks of `rows` rows are still timed to fit T(s) (they must then run whole: `Engine.chunk_length`)."""
    bucket = self.buckets.get(rows)
    return bucket is None or bucket.fitted is None

  def observe(self, rows: int, seconds: float, steps: int) -> None:
    """The chunk that ran with `table(rows)` took `seconds` for `steps` steps."""
    bucket = self.buckets[rows]
    if not bucket.compiled:
      bucket.compiled = True
      return
    if bucket.pinned is None or steps < 1:
      return
    bucket.times.setdefault(bucket.pinned, []).append(seconds / steps)
    if all(len(bucket.times.get(s, ())) >= self.samples for s in self.sizes):
      bucket.fitted, bucket.fit = step_times(self.sizes, [float(np.median(bucket.times[s])) for s in self.sizes])

  def fits(self) -> dict[int, tuple[float, float]]:
    """rows bucket -> (alpha, beta) of the buckets calibrated so far."""
    return {rows: b.fit for rows, b in sorted(self.buckets.items()) if b.fit is not None}
