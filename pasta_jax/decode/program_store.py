"""Compiled decode loops kept on disk, so that a second process runs the loop the first compiled.

A loop's XLA executable is stored under a digest of everything that decides the program: the runner, the model
module, the static interpreter config, the argument shapes, and the environment (jax and jaxlib versions, the
backend and its devices, XLA_FLAGS, and the source of this package). A hit skips tracing, lowering and compiling
(jax.experimental.serialize_executable); JAX's own persistent cache would still trace and lower the loop to find
its key, which costs seconds for the interpreter's step.

On by default in the user's cache folder (`user_cache`: ~/.cache/pasta_jax/programs); `pasta --no-compile-cache`
or $PASTA_COMPILE_CACHE=off turns it off, $PASTA_COMPILE_CACHE=folder moves it. A file that cannot be read back (torn,
or from another build) is removed and the loop compiled again: the store never changes what a run computes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import zlib
from pathlib import Path

import jax

from pasta_jax.model import runfiles, user_cache

MAX_PROGRAMS = 48  # the oldest beyond this are removed (a program is a few MB compressed)
SUFFIX = ".program"


def default_folder() -> Path | None:
  """The programs' folder in the user's cache (`user_cache`; None: off)."""
  return user_cache.folder("programs")


@functools.cache
def source_fingerprint() -> str:
  """A digest of this package's Python source: a changed step or rule is a different program."""
  root = Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*.py")):
    digest.update(str(path.relative_to(root)).encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


def environment() -> tuple:
  """What besides the program's own description changes its executable."""
  import jaxlib

  devices = tuple((d.platform, d.device_kind) for d in jax.devices())
  return (jax.__version__, jaxlib.__version__, sys.version_info[:2], devices, jax.process_count(),
          os.environ.get("XLA_FLAGS", ""), source_fingerprint())


def describe_model_fn(model_fn) -> str:
  """A stable description of the decode model (a Flax module's bound `apply`: its module's fields)."""
  module = getattr(model_fn, "__self__", None)
  return repr(module) if module is not None else f"{model_fn.__module__}.{model_fn.__qualname__}"


def digest(parts: tuple) -> str:
  """The file name of a program described by `parts` (reprs must hold no addresses: checked)."""
  text = repr((parts, environment()))
  if " at 0x" in text:  # an object without a stable repr would make every process miss (or, worse, collide)
    raise ValueError(f"a compiled program's description has no stable form: {text[:300]}")
  return hashlib.sha256(text.encode()).hexdigest()[:40]


class ProgramStore:
  """Executables by digest in `folder`; `hits` and `saves` count this process's loads and writes."""

  def __init__(self, folder: Path | None):
    self.folder = folder
    self.hits = self.saves = self.failures = 0

  def path(self, key: str) -> Path:
    return self.folder / f"{key}{SUFFIX}"

  def load(self, key: str):
    """The stored executable for `key`, or None (not stored, off, or unreadable: then removed)."""
    if self.folder is None:
      return None
    path = self.path(key)
    try:
      blob = path.read_bytes()
    except OSError:
      return None
    from jax.experimental.serialize_executable import deserialize_and_load
    try:
      payload, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
      compiled = deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # torn or from another build: compile again (the digest should have told them apart)
      self.failures += 1
      path.unlink(missing_ok=True)
      return None
    os.utime(path)  # recently used: kept longest
    self.hits += 1
    return compiled

  def save(self, key: str, compiled) -> None:
    """Stores `compiled` atomically (a reader never sees half a file); a full or read-only disk skips it."""
    if self.folder is None:
      return
    from jax.experimental.serialize_executable import serialize
    try:
      blob = zlib.compress(pickle.dumps(serialize(compiled)), 1)
      self.folder.mkdir(parents=True, exist_ok=True)
      runfiles.write_atomic(self.path(key), blob)
    except (OSError, ValueError, TypeError, pickle.PicklingError):
      self.failures += 1
      return
    self.saves += 1
    self._trim()

  def _trim(self) -> None:
    programs = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in programs[MAX_PROGRAMS:]:
      old.unlink(missing_ok=True)
