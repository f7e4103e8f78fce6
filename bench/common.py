"""Shared helpers for the benchmarks: timing medians and memory bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def median_time(fn: Callable[[], object], runs: int, warmup: int = 1) -> tuple[float, list[float]]:
  """Median wall time of `runs` calls after `warmup` untimed calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), times


def copy_bandwidth(num_bytes: int = 512 << 20, runs: int = 5) -> float:
  """Bytes moved per second by a large memory copy (read + write, STREAM 'copy' convention) on JAX's
  default device: host memory on CPU, device memory on an accelerator."""
  if jax.default_backend() == "cpu":
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    seconds, _ = median_time(lambda: np.copyto(dst, src), runs)
  else:
    src = jnp.ones(num_bytes // 4, jnp.float32)
    copy = jax.jit(lambda x: x + 1)  # one read and one write of every element
    seconds, _ = median_time(lambda: copy(src).block_until_ready(), runs)
  return 2 * num_bytes / seconds


def second_of_two(fn):
  """Runs fn twice and returns the second result: the first compiles and warms up."""
  fn()
  return fn()


def table(rows: list[dict], columns: tuple[str, ...], width: int = 12) -> str:
  """Fixed-width text table; floats with 3 decimals."""
  lines = [" ".join(f"{c:>{width}}" for c in columns)]
  for r in rows:
    lines.append(" ".join(f"{r[c]:>{width}.3f}" if isinstance(r[c], float) else f"{r[c]!s:>{width}}" for c in columns))
  return "\n".join(lines)
