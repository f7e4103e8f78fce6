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
    return 2 * num_bytes / seconds
  src = jnp.ones(num_bytes // 4, jnp.float32)
  repeats = 10  # copies inside one program, so the call's dispatch does not count
  copy = jax.jit(lambda x: jax.lax.fori_loop(0, repeats, lambda _, y: y + 1, x))  # each: one read, one write
  seconds, _ = median_time(lambda: copy(src).block_until_ready(), runs)
  return 2 * num_bytes * repeats / seconds


def device_time(fn: Callable, args: tuple, runs: int, inner: int = 50) -> float:
  """Seconds per call of jax function `fn(*args)` (its result shaped like args[0]) on the device alone: `inner`
  calls chained inside one program, median of `runs` programs, divided by `inner`. Nothing is hoisted out of the
  loop: each call's first argument moves by its result, and every integer argument (metadata, positions) gets a
  zero the compiler cannot prove zero (the loop index minus a carried counter), so per-call work such as
  building a mask from metadata is paid on every call, as in a decode step."""
  def chained(*a):
    def body(i, carry):
      first, counter = carry
      zero = i - counter
      rest = jax.tree.map(lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else x, a[1:])
      return first + (1e-3 * fn(first, *rest)).astype(first.dtype), counter + 1
    return jax.lax.fori_loop(0, inner, body, (a[0], jnp.int32(0)))[0]

  program = jax.jit(chained)
  seconds, _ = median_time(lambda: program(*args).block_until_ready(), runs)
  return seconds / inner


def second_of_two(fn):
  """Runs fn twice and returns the second result: the first compiles and warms up."""
  fn()
  return fn()


def run_ids(model, ids, method, **kw) -> list:
  """`pasta_jax.methods.generate_ids`, also taking `prepare_run`'s engine options (lane_buckets, pool_tokens,
  defer_kv_writes): one `Result` per prompt of `ids`."""
  from pasta_jax.decode import api
  from pasta_jax.methods import prepare_run
  prep = prepare_run(model, ids, method, **kw)
  runs, seconds = api.run_prepared(prep)
  lang = api.LangTokenizer(model.tokenizer)
  return [api.to_result(r, seconds, lang, prep) for r in runs]


def plain_step(model, ids, text: str, repeats: int = 1, **kw) -> tuple[float, float]:
  """(seconds per step, prefill seconds) of plain decoding (`Sequential()`) on prompt ids `ids`, replaying the
  tag-free `text` and its first half in the same pool and step budget: the slope and the intercept of the two
  lengths. Each time is the median of `repeats` runs, each the second of two. `kw`: `generate_ids`'s options
  (max_new_tokens, runtime)."""
  from pasta_jax.decode import api
  from pasta_jax.methods import Sequential, generate_ids
  lang = api.LangTokenizer(model.tokenizer)
  tokens = lang.encode(text)
  half = lang.decode(tokens[: len(tokens) // 2])

  def run(answer):
    results = [second_of_two(lambda: generate_ids(model, [ids], Sequential(), forced_answers=[answer], **kw)[0])
               for _ in range(repeats)]
    return sorted(r.seconds for r in results)[len(results) // 2], results[0].steps

  (full_s, full_n), (half_s, half_n) = run(text), run(half)
  step = (full_s - half_s) / max(full_n - half_n, 1)
  return step, max(full_s - full_n * step, 0.0)


def table(rows: list[dict], columns: tuple[str, ...], width: int = 12) -> str:
  """Fixed-width text table; floats with 3 decimals."""
  lines = [" ".join(f"{c:>{width}}" for c in columns)]
  for r in rows:
    lines.append(" ".join(f"{r[c]:>{width}.3f}" if isinstance(r[c], float) else f"{r[c]!s:>{width}}" for c in columns))
  return "\n".join(lines)


def held_out_prompt_ids(model, limit: int) -> list[list[int]]:
  """The first `limit` alpaca_eval_805 instructions (held out of every training pool), in chat turns."""
  from pasta_jax.data import sources
  from pasta_jax.decode.tokenizing import prompt_ids
  instructions = [r["instruction"] for r in sources.read_records("alpaca_eval_805")][:limit]
  return prompt_ids(model.tokenizer, instructions, chat=True)
