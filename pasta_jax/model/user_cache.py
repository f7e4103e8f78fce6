"""The user's cache folder for what a process can reuse from an earlier one: compiled decode loops
(`decode.program_store`), the output head's measured plan (`model.head_timing`), the weights in the decode layout
(`decode.layout_store`) and a training run's compiled steps (`training.compile_cache`).

~/.cache/pasta_jax (or $XDG_CACHE_HOME/pasta_jax) by default; $PASTA_COMPILE_CACHE=folder moves it and
$PASTA_COMPILE_CACHE=off (or `pasta --no-compile-cache`) turns every part off.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PASTA_COMPILE_CACHE"  # a folder, or "off"


def folder(part: str) -> Path | None:
  """The folder of one part of the cache ("programs", "head_plans"), or None when the cache is off."""
  setting = os.environ.get(ENV, "")
  if setting.lower() == "off":
    return None
  root = Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pasta_jax"
  return root / part


def turn_off() -> None:
  """Every part off for this process (and the processes it starts)."""
  os.environ[ENV] = "off"
