"""An adapter folded into its GGUF base, kept beside the base's own cache so that a later process maps the folded
weights (`weight_file`) instead of loading the base and folding again (2-3 s for Gemma 3 270M on a 2-core CPU).

A file is named by the base's cache key, the adapter files' digest and the dtype: a retrained adapter or a changed
base is folded again. The KEEP most recently used are kept (each is a whole model: 1 GB for Gemma 3 270M in
float32).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import jax.numpy as jnp

from pasta_jax.model import gguf_loader, lora, weight_file
from pasta_jax.model.config import GemmaConfig, config_from_dict, config_to_dict

log = logging.getLogger(__name__)

FORMAT = 1  # bump when folding changes what it computes
KEEP = 3


def path_for(adapter_folder: Path, gguf: Path, dtype, cache_dir) -> Path | None:
  """Where `adapter_folder` folded into `gguf` is kept (None: caching is off, cache_dir=False)."""
  if cache_dir is False:
    return None
  digest = hashlib.sha256(str(FORMAT).encode())
  for name in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
    digest.update((adapter_folder / name).read_bytes())
  root = Path(cache_dir) if cache_dir else gguf_loader.default_cache_dir(gguf)
  name = f"{gguf_loader.cache_key(gguf)}-fold-{digest.hexdigest()[:16]}-{jnp.dtype(dtype).name}"
  return root / f"{name}{gguf_loader.CACHE_SUFFIX}"


def read(path: Path) -> tuple[GemmaConfig, dict] | None:
  """(config, params) kept at `path`, or None (a torn or foreign file: the caller folds again and rewrites it)."""
  try:
    flat, metadata = weight_file.load(path)
    config = config_from_dict(metadata["config"])
  except Exception:
    return None
  os.utime(path)  # recently used: kept longest
  return config, {"params": weight_file.unflatten(flat)}


def write(path: Path, config: GemmaConfig, params: dict) -> bool:
  """Keeps the folded model (the oldest beyond KEEP are removed); whether it was written."""
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    weight_file.save(path, weight_file.flatten(params["params"]), {"config": config_to_dict(config)})
  except (OSError, ValueError, TypeError) as e:  # full or read-only disk: the cache is an optimisation only
    log.warning("could not keep the folded adapter in %s: %s", path, e)
    return False
  folded = sorted(path.parent.glob(f"*-fold-*{gguf_loader.CACHE_SUFFIX}"), key=lambda p: p.stat().st_mtime)
  for old in folded[:-KEEP]:
    old.unlink(missing_ok=True)
  return True
