"""JAX's persistent compilation cache for the `pasta` commands: the second run of a command reuses the
XLA executables the first compiled, instead of compiling the same fixed-shape loop again.

Opt-in (`pasta --compile-cache ...` or $PASTA_COMPILE_CACHE=folder): with jax 0.10.2 on CPU, writing
one of the SoT loops' executables to the cache aborted the process (jax compilation_cache.py,
put_executable_and_time), so it is not on by default until that is understood."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PASTA_COMPILE_CACHE"  # a folder, or "off"


def cache_folder(requested: bool = False) -> Path | None:
  """$PASTA_COMPILE_CACHE ("off" disables it); else, if `requested`, the user's cache folder; else None."""
  setting = os.environ.get(ENV, "")
  if setting.lower() == "off":
    return None
  if setting:
    return Path(setting)
  if not requested:
    return None
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
