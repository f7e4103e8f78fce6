"""Judges by name, as `pasta eval`, bench.learned and BoNBoN's rounds take them: auto, none, http or
local[:MODEL]. Every judge comes wrapped in a cache under the run folder, so a rerun asks nothing twice."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pasta_jax.endpoint import EndpointConfig
from pasta_jax.errors import PastaError
from pasta_jax.judges.base import Judge
from pasta_jax.judges.cache import CachedJudge
from pasta_jax.judges.http import HttpJudge
from pasta_jax.judges.local import LocalJudge

JUDGE_URL_ENV = "PASTA_JUDGE_BASE_URL"
VERDICTS_FILE = "verdicts.jsonl"
BASE_MODEL_NOTE = ("The judge is the embedded Gemma 3 270M base model: not a meaningful judge (it does not follow "
                   "judging instructions); treat win rates as a smoke test.")


def make_judge(spec: str, out_dir: Path, load_model: Callable[[str | None], object], *,
               allow_http_key: bool = False) -> tuple[Judge | None, str]:
  """(the judge `spec` names, cached in out_dir/verdicts.jsonl, or None; a note for the report).

  auto is http when PASTA_JUDGE_BASE_URL is set, else none; local without a MODEL is the base model.
  load_model: a path (None: the base model) -> a loaded model; pass the run's model cache, so that a local
  judge and the methods it judges share one copy of a model. allow_http_key: an http judge may send its
  API key over plain http:// to a host that is not loopback (EndpointConfig.allow_insecure_key)."""
  kind, _, model_path = spec.partition(":")
  if kind == "auto":
    if not os.environ.get(JUDGE_URL_ENV):
      return None, f"No judge configured: set {JUDGE_URL_ENV} (or pass --judge local:MODEL) to judge quality."
    kind = "http"
  if kind == "none":
    return None, "--judge none."
  if kind == "http":
    judge, note = HttpJudge(EndpointConfig.from_env(allow_insecure_key=allow_http_key)), ""
  elif kind == "local":
    judge, note = LocalJudge(load_model(model_path or None)), "" if model_path else BASE_MODEL_NOTE
  else:
    raise PastaError(f"unknown judge {spec!r}; use auto, none, http or local[:MODEL]")
  return CachedJudge(judge, out_dir / VERDICTS_FILE), note
