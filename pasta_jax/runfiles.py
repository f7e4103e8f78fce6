"""Run folders that resume: an identity file refusing other settings, and append-only JSONL rows.

Rows are appended and flushed one at a time, so a killed run loses at most the row being written;
reading skips that half-written last line and ends it, so the next append starts on a clean line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pasta_jax.errors import PastaError


class RunDirError(PastaError):
  """A run folder holds a different run, or files that cannot be read."""


def claim(folder: str | Path, identity: dict, file_name: str = "run.json") -> Path:
  """Creates `folder` for this run, or checks that the run already in it has the same identity."""
  folder = Path(folder)
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise RunDirError(f"cannot create folder {folder}: {err.strerror}") from None
  run_file = folder / file_name
  if not run_file.exists():
    run_file.write_text(json.dumps(identity, indent=2) + "\n")
    return folder
  try:
    previous = json.loads(run_file.read_text())
  except (OSError, json.JSONDecodeError) as err:
    raise RunDirError(f"cannot read {run_file} ({err}); use another folder") from None
  changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
  if changed:
    diffs = "; ".join(f"{k}: {previous.get(k)!r} then, {identity.get(k)!r} now" for k in changed)
    raise RunDirError(f"{folder} holds a run with other settings ({diffs}); use another folder or the same settings")
  return folder


def read_rows(path: str | Path) -> Iterator[dict]:
  """The complete JSON rows of a JSONL file (none if it does not exist)."""
  path = Path(path)
  if not path.exists():
    return
  text = path.read_text()
  if text and not text.endswith("\n"):
    with open(path, "a") as f:
      f.write("\n")
  for line in text.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # the last line of a killed run, half written
    if isinstance(row, dict):
      yield row


def append_row(path: str | Path, row: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")
    f.flush()


def write_rows(path: str | Path, rows) -> None:
  """Replaces a JSONL file atomically (write then rename)."""
  path = Path(path)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
  tmp.replace(path)
