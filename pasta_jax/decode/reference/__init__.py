"""The pure-Python reference interpreter (the test oracle of the jitted one), one request at a time.

  pasta.py   PASTA's rules (docs/interpreter.md), with explicit visible sets: the shared request base
  apar.py    APAR's rules on that base (docs/interpreter.md, APAR mode)
This module is the entry: `run_reference` runs the rules of its `request` class (`Request`: PASTA's, or
`AparRequest`).
"""

from __future__ import annotations

from collections.abc import Callable

from pasta_jax.decode.reference.apar import AparRequest
from pasta_jax.decode.reference.pasta import (
  POSITION_MODES,
  ReferenceResult,
  Request,
  Settings,
  constraint_mask,
  content_length,
)
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.lang import schema
from pasta_jax.lang.tags import TagVocab

__all__ = ["AparRequest", "ReferenceResult", "Request", "constraint_mask", "content_length", "run_reference"]


def run_reference(model_fn: Callable, params, prompts: list[list[int]], vocab: TagVocab, *, lanes: int,
                  max_threads: int, pool_slots: int, max_steps: int, sampling: SamplingConfig,
                  script: list[list[list[int]]] | None = None,
                  position_mode: str = "pred", bucket: bool = True, request: type[Request] = Request,
                  max_depth: int = 3, initial_threads: int = 1,
                  sample_after_script: bool = False) -> list[ReferenceResult]:
  """Run each request alone, exactly as docs/interpreter.md says; B prompts -> B results.

  model_fn: the signature of `Gemma(cfg).apply` / `toy_model.toy_apply` (a `ModelOutput`), called without a pool.
  lanes: T (lane 0 = main); max_threads: U (thread ids 0 ... U-1, main included); pool_slots: S
  (the prompt included); max_steps: the budget for steps 1, 2, ... (step 0 is not counted).
  script: forced replay: script[b][u] is thread u's tokens (main's ending with an end id; a fork's
  content ending with ASYNC_END, without the inserted ASYNC). The model still runs and its logits
  are recorded. position_mode: one of `schema.POSITION_MODES` ('pred': R from LENGTH;
  'fixed': R = 42; the oracle modes: R from the true block length, forced mode only). request:
  `Request` (PASTA's rules), or `AparRequest` (APAR's, `reference/apar.py`; max_depth is its fork depth limit,
  initial_threads its fan-out, sample_after_script makes scripts prefixes that sampling continues). bucket: pad each
  model call to a power-of-two length (fewer shapes to compile) with pad rows masked out both ways,
  which leaves the query's row unchanged up to float summation order; False makes the literal
  unpadded call.
  """
  if position_mode not in POSITION_MODES:
    raise ValueError(f"position_mode must be one of {POSITION_MODES}, got {position_mode!r}")
  if position_mode in schema.ORACLE_MODES and script is None:
    raise ValueError(f"position_mode={position_mode!r} needs a script (forced replay only)")
  if script is not None and len(script) != len(prompts):
    raise ValueError(f"script has {len(script)} requests, prompts has {len(prompts)}")
  if lanes < 1 or max_threads < 1 or max_steps < 0:
    raise ValueError(f"need lanes >= 1, max_threads >= 1, max_steps >= 0 (got {lanes}, {max_threads}, "
                     f"{max_steps})")
  if not (isinstance(request, type) and issubclass(request, Request)):
    raise ValueError(f"request must be a reference Request class (Request or AparRequest), got {request!r}")
  cfg = Settings(model_fn, params, vocab, lanes, max_threads, pool_slots, max_steps, sampling,
                  position_mode, bucket, max_depth, initial_threads, sample_after_script)
  return [_run_one(cfg, request, b, list(prompt), None if script is None else script[b])
          for b, prompt in enumerate(prompts)]


def _run_one(cfg: Settings, kind: type[Request], index: int, prompt: list[int], script) -> ReferenceResult:
  """Start, then steps 1 ... max_steps until finished or truncated (docs/interpreter.md, Stop)."""
  if not 0 < len(prompt) <= cfg.pool_slots:
    raise ValueError(f"request {index}: prompt of {len(prompt)} tokens does not fit {cfg.pool_slots} slots")
  request = kind(cfg, index, prompt, script)
  for step in range(1, cfg.max_steps + 1):
    request.step(step)
    if request.finished or request.truncated:
      break
  if not request.finished:
    request.truncated = True  # the step budget ran out
  return request.result()
