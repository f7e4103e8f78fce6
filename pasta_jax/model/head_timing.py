"""The output head's forms timed on this machine (model/head_plan.py says why): once per machine, on a CPU."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.model import runfiles, user_cache
from pasta_jax.model.gemma import narrow_head, output_head
from pasta_jax.model.head_plan import FIXED, HeadPlan, choose
from pasta_jax.model.int8_head import int8_logits, quantize_head

ENV = "PASTA_HEAD_PLAN"  # "measured" (default: measured on a CPU, fixed elsewhere) or "fixed"
MEASURED_ROWS = (2, 3, 4, 8)  # the lane buckets of a step of several rows (decode/step.py), and batches of 3


def time_forms(vocab: int, dim: int, dtype, narrow_dtype, rows=MEASURED_ROWS, rounds: int = 5) -> dict:
  """{(rows, form): median seconds} of the head's forms on a [vocab, dim] head, timed in interleaved rounds."""
  head = jnp.full((vocab, dim), 0.01, dtype)
  heads = {"weight_major": (head,), "token_major": (head,)}
  if narrow_dtype is not None:
    int8 = jnp.dtype(narrow_dtype) == jnp.int8
    heads["narrow"] = quantize_head(head) if int8 else (narrow_head(head, narrow_dtype),)
  runs = {}
  for r in rows:
    x = jnp.full((1, r, dim), 0.5, dtype)
    for form, w in heads.items():  # each form exactly as the model (or the certified head) computes it
      plan = HeadPlan(token_major=(r,) if form == "token_major" else ())
      head_fn = (lambda x, q, s: int8_logits(x, q, s)[0]) if len(w) == 2 else functools.partial(
          output_head, decode_layout=True, plan=plan)
      run = jax.jit(head_fn)
      jax.block_until_ready(run(x, *w))  # compile and warm up
      runs[(r, form)] = functools.partial(run, x, *w)
  seconds = {key: [] for key in runs}
  for _ in range(rounds):
    for key, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      seconds[key].append(time.perf_counter() - start)
  return {key: float(np.median(s)) for key, s in seconds.items()}


@functools.lru_cache(maxsize=8)
def measured_plan(vocab: int, dim: int, dtype: str, narrow_dtype: str | None) -> HeadPlan:
  """This machine's plan for a [vocab, dim] head: measured on a CPU backend (a few seconds on a 262k head) once per
  machine, kept in the user's cache (`user_cache`; measured once per process when it is off); FIXED on other
  backends or when PASTA_HEAD_PLAN=fixed."""
  setting = os.environ.get(ENV, "measured")
  if setting not in ("measured", "fixed"):
    raise ValueError(f"{ENV} must be 'measured' or 'fixed', got {setting!r}")
  if setting == "fixed" or jax.default_backend() != "cpu":
    return FIXED
  path = _plan_path(vocab, dim, dtype, narrow_dtype)
  saved = _read_plan(path)
  if saved is not None:
    return saved
  plan = choose(time_forms(vocab, dim, jnp.dtype(dtype), narrow_dtype and jnp.dtype(narrow_dtype)),
                narrow_dtype is not None)
  if path is not None:
    try:
      runfiles.write_json(path, dataclasses.asdict(plan))
    except OSError:  # a read-only or full cache: measured again next time
      pass
  return plan


def _plan_path(vocab: int, dim: int, dtype: str, narrow_dtype: str | None) -> Path | None:
  """Where this machine's plan for these shapes is kept: keyed by the processor, its cores and the jax version."""
  folder = user_cache.folder("head_plans")
  if folder is None:
    return None
  machine = (platform.processor(), _cpu_model(), os.cpu_count(), jax.__version__, vocab, dim, dtype, narrow_dtype)
  return folder / f"{hashlib.sha256(repr(machine).encode()).hexdigest()[:24]}.json"


def _cpu_model() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.machine()


def _read_plan(path: Path | None) -> HeadPlan | None:
  if path is None or not path.is_file():
    return None
  try:
    fields = json.loads(path.read_text())
    return HeadPlan(tuple(fields["token_major"]), tuple(fields["exact"]), tuple(map(tuple, fields["measured"])))
  except (OSError, ValueError, KeyError, TypeError):  # torn or from another version: measured again
    return None
