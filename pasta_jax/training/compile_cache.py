"""Compiled training steps kept on disk, so that a resumed run does not compile its steps again.

A run batched by length compiles one train step per length bucket; with a KL toward a reference over a 262k
vocabulary one such compile takes minutes on a CPU, and a run killed and resumed paid all of them again (about 25
minutes for the 270M's nine padded lengths on 2 cores). The trainer turns on JAX's persistent compilation cache in
the user's cache folder (`model.user_cache`, part "xla"): its key covers the program, the compile options, the
backend and XLA's flags, so a hit runs exactly what a compile would have built.

Left alone where the user set a JAX cache folder ($JAX_COMPILATION_CACHE_DIR) and off where the pasta cache is off
($PASTA_COMPILE_CACHE=off, `pasta --no-compile-cache`).
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from pasta_jax.model import user_cache

PART = "xla"
MAX_BYTES = 4 * 1024**3  # the oldest entries beyond this are removed


def keep_compiled_programs() -> Path | None:
  """Turns the persistent cache on for this process (from its next compile on); returns its folder, or None
  when the cache is off."""
  chosen = jax.config.jax_compilation_cache_dir
  if chosen:
    return Path(chosen)
  folder = user_cache.folder(PART)
  if folder is None:
    return None
  jax.config.update("jax_compilation_cache_dir", str(folder))
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  compilation_cache.reset_cache()  # a process that compiled before has already decided it runs without one
  return folder
