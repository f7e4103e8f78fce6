"""JAX's persistent compilation cache for the `pasta` commands: the second run of a command reuses the
XLA executables the first compiled, instead of compiling the same fixed-shape loop again."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PASTA_COMPILE_CACHE"  # a folder, or "off"


def cache_folder() -> Path | None:
  """$PASTA_COMPILE_CACHE ("off" disables it), else the user's cache folder."""
  setting = os.environ.get(ENV, "")
  if setting.lower() == "off":
    return None
  if setting:
    return Path(setting)
  return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pasta_jax" / "xla"


def enable(folder: Path | None) -> Path | None:
  """Turns the cache on in `folder` (None: leaves it off). Returns the folder in use."""
  if folder is None:
    return None
  import jax

  folder.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  # the decode loops compile in seconds on CPU: keep every executable, however quick or small
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
