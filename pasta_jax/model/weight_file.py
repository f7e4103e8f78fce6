"""A file of named arrays that loads by mapping, not copying: the caches of converted weights.

Loading a gigabyte of weights by reading it into new memory costs seconds on a small VM (every fresh page is
faulted in and zeroed: 1.7 s for 1 GB on a 2-core CPU), while mapping the file costs only the page-cache pages'
first touch. Each array starts on a page boundary, so `jax.device_put(..., may_alias=True)` hands XLA:CPU the
mapped pages themselves; the map is copy-on-write, so nothing can ever write back into the file. On an
accelerator the same call copies to the device, as any load does.

Layout: MAGIC, an 8-byte little-endian header length, a JSON header {"metadata": ..., "arrays": {name: [dtype,
shape, offset, nbytes]}}, then the arrays at page-aligned offsets. Written to a temporary name and renamed, so a
reader (or a process that has the old file mapped) never sees half a file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import jax
import numpy as np

MAGIC = b"PASTAW1\n"
ALIGN = 4096  # a page: what zero-copy needs, and more than XLA:CPU's 64-byte alignment


class WeightFileError(ValueError):
  """The file is not a whole weight file (torn, truncated, or another format)."""


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  """A nested dict of arrays -> '/'-joined names -> arrays."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{key}/"))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def unflatten(flat: dict[str, Any]) -> dict:
  """`flatten`'s inverse."""
  tree: dict = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def _aligned(offset: int) -> int:
  return -(-offset // ALIGN) * ALIGN


def save(path: str | os.PathLike, arrays: dict[str, Any], metadata: dict) -> None:
  """Writes `arrays` (flat names -> host or device arrays) and JSON-able `metadata` atomically."""
  path = Path(path)
  host = {name: np.asarray(jax.device_get(a), order="C") for name, a in arrays.items()}  # 0-d stays 0-d
  entries, offset = {}, 0
  for name, a in host.items():
    entries[name] = [a.dtype.name, list(a.shape), offset, a.nbytes]
    offset = _aligned(offset + a.nbytes)
  header = json.dumps({"metadata": metadata, "arrays": entries}).encode()
  start = _aligned(len(MAGIC) + 8 + len(header))
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  try:
    with open(tmp, "wb") as f:
      f.write(MAGIC + struct.pack("<Q", len(header)) + header)
      for name, a in host.items():
        f.seek(start + entries[name][2])
        f.write(a.reshape(-1).view(np.uint8))  # bytes of any dtype (a buffer cannot hold bfloat16's)
      f.truncate(start + offset)
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
  """(header, data start) of a weight file; WeightFileError if it is not one or is shorter than it says."""
  path = Path(path)
  with open(path, "rb") as f:
    if f.read(len(MAGIC)) != MAGIC:
      raise WeightFileError(f"{path} is not a weight file")
    field = f.read(8)
    if len(field) < 8:
      raise WeightFileError(f"{path} is cut short in its header")
    (length,) = struct.unpack("<Q", field)
    try:
      header = json.loads(f.read(length))
    except (ValueError, RecursionError):
      raise WeightFileError(f"{path}: unreadable header") from None
  start = _aligned(len(MAGIC) + 8 + length)
  end = max((start + off + n for _, _, off, n in header["arrays"].values()), default=start)
  if path.stat().st_size < end:
    raise WeightFileError(f"{path} is cut short ({path.stat().st_size} of {end} bytes)")
  return header, start


def load(path: str | os.PathLike) -> tuple[dict[str, jax.Array], dict]:
  """(flat name -> device array, metadata). On a CPU the arrays are the file's mapped pages (copy-on-write)."""
  header, start = read_header(path)
  mapped = np.memmap(path, dtype=np.uint8, mode="c")
  arrays = {}
  for name, (dtype, shape, offset, nbytes) in header["arrays"].items():
    view = mapped[start + offset:start + offset + nbytes].view(jax.numpy.dtype(dtype)).reshape(shape)
    arrays[name] = jax.device_put(view, may_alias=True)
  return arrays, header["metadata"]
