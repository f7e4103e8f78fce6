"""Run and checkpoint locations that may be local or remote (gs://...): one path type for both.

TPU jobs write checkpoints, metrics and the exported model to a bucket every host can reach;
`etils.epath` gives local and GCS paths the same interface, and Orbax takes them as they are.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
  return "://" in os.fspath(path)


def run_path(path: str | os.PathLike) -> epath.Path:
  """An epath; local paths made absolute (Orbax requires absolute paths)."""
  return epath.Path(path) if is_remote(path) else epath.Path(os.path.abspath(os.fspath(path)))


def copy_tree(src: str | os.PathLike, dst: epath.Path) -> None:
  """Copies a local folder's files into `dst` (local or remote)."""
  for root, _, files in os.walk(src):
    rel = os.path.relpath(root, src)
    target = dst if rel == "." else dst / rel
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
      (target / name).write_bytes(open(os.path.join(root, name), "rb").read())


def save_folder(dst: epath.Path, write) -> None:
  """Runs `write(local_dir)` (e.g. a tokenizer's save) and puts what it wrote at `dst`, local or remote."""
  if not is_remote(dst):
    write(os.fspath(dst))
    return
  tmp = tempfile.mkdtemp()
  try:
    write(tmp)
    copy_tree(tmp, dst)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
