"""A model's weights in the decode layout, kept on disk so that a later process maps them instead of converting.

The decode layout transposes every projection (`model.gemma.to_decode_layout`), which costs 0.6 s for Gemma 3 270M
on a 2-core CPU, most of it faulting in the new memory. Weights that a later process recognizes (a model whose
`weights_id` names the cache file they were mapped from) are converted once and stored as a `model.weight_file` in
the user's cache (`user_cache`: "decode_weights"), named by that id, the dtypes, and the environment that decides
the conversion (`program_store.environment`: versions and this package's source).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from pasta_jax.decode import program_store
from pasta_jax.model import user_cache, weight_file

log = logging.getLogger(__name__)

PART = "decode_weights"
KEEP = 2  # the oldest beyond this are removed (each is a whole model: 1 GB for Gemma 3 270M in float32)


def stored_path(weights_id: str | None, dtype: str, head_dtype: str | None) -> Path | None:
  """Where these weights' decode layout is kept (None: the weights have no id, or the cache is off)."""
  folder = user_cache.folder(PART)
  if weights_id is None or folder is None:
    return None
  key = repr((weights_id, dtype, head_dtype, program_store.environment()))
  return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.weights"


def load(path: Path) -> dict | None:
  """The stored tree, or None (not stored, or unreadable: converted and stored again)."""
  try:
    flat, _ = weight_file.load(path)
  except (OSError, ValueError):
    return None
  path.touch()  # recently used: kept longest
  return weight_file.unflatten(flat)


def save(path: Path, tree: dict) -> None:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    weight_file.save(path, weight_file.flatten(tree), {})
  except (OSError, ValueError, TypeError) as e:  # a full or read-only disk: the next process converts again
    log.warning("could not keep the decode-layout weights in %s: %s", path, e)
    return
  kept = sorted(path.parent.glob("*.weights"), key=lambda p: p.stat().st_mtime)
  for old in kept[:-KEEP]:
    old.unlink(missing_ok=True)
