"""Files of resumable jobs, written so that a SIGKILL at any moment leaves nothing a resume would trust wrongly.

  write_atomic / save_atomic   a whole file: written beside its target, fsynced, then renamed over it, so a
                               reader sees the old file or the new one, never a torn one
  append_row / append_rows     JSONL rows; a torn last line (unterminated, or not JSON) left by a killed writer
                               is cut off first, so new rows never follow half a row
  read_rows / write_rows       the complete rows of a JSONL file (cutting a torn last line); an atomic rewrite
  partial_folder / publish     a folder (an exported model, trained heads) written under a temporary sibling
  (or `publishing`)            name and renamed into place, the old one removed only after; the completion
                               marker is written last, and `is_complete` is what resume trusts
  claim / check_settings       a run's settings, kept in its folder: a resume under other settings is refused
                               with an error naming each changed field, its old and its new value

A SIGKILL loses what the page cache has not yet been given, never what it has: appends are flushed per row.
Whole files are also fsynced before their rename, so a finished file survives a crash of the machine too.

Remote paths (gs://...) have no rename and no append: an object is written whole (an object store's put is
atomic already) and a folder is written in place, its marker last.

Tests kill a job at a chosen write with $PASTA_KILL_AT="LABEL:N" (`kill_point`): the N-th time this process
reaches a point with that label it SIGKILLs itself, after leaving the state a real kill there would (half of an
appended row, a finished temporary file not yet renamed, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pasta_jax.errors import PastaError
from pasta_jax.paths import is_remote

KILL_ENV = "PASTA_KILL_AT"
COMPLETE = "COMPLETE"  # the marker file of a published folder, written last
_TAIL_CHUNK = 1 << 16


class RunDirError(PastaError):
  """A run folder holds a different run, or files that cannot be read."""


# --- kill points (tests) -------------------------------------------------------------------------------
_kill_counts: dict[str, int] = {}


def kill_due(kind: str, name: str = "") -> bool:
  """True when $PASTA_KILL_AT="LABEL:N" names this point (LABEL is `kind` or `kind/name`) for the N-th time in
  this process. The caller leaves the state a kill there leaves, then calls `die()`."""
  spec = os.environ.get(KILL_ENV)
  if not spec:
    return False
  label, _, count = spec.rpartition(":")
  if label not in (kind, f"{kind}/{name}"):
    return False
  _kill_counts[label] = _kill_counts.get(label, 0) + 1
  return _kill_counts[label] == int(count)


def die() -> None:
  """SIGKILL this process: no cleanup, no flush of Python's buffers, no atexit (as a real kill)."""
  os.kill(os.getpid(), signal.SIGKILL)


def kill_point(kind: str, name: str = "") -> None:
  if kill_due(kind, name):
    die()


# --- whole files ---------------------------------------------------------------------------------------
def _remote(path) -> bool:
  return is_remote(path)


def _fsync_dir(folder: Path) -> None:
  try:
    fd = os.open(folder, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass  # some file systems do not sync folders; the rename is still atomic
  finally:
    os.close(fd)


def temp_path(path: str | os.PathLike) -> Path:
  """The temporary sibling a file is written to before its rename (the suffix kept: np.savez adds .npz to a
  name without it, np.save .npy)."""
  path = Path(path)
  return path.with_name(f".{path.name}.tmp{path.suffix}")


def save_atomic(path: str | os.PathLike, write) -> Path:
  """Runs `write(tmp)` (np.savez, safetensors' save_file, ...) on a temporary sibling, fsyncs it, renames it
  over `path`. Until the rename `path` keeps its old content; if `write` raises, the temporary file is removed."""
  if _remote(path):
    write(path)
    return path
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = temp_path(path)
  try:
    write(tmp)
    with open(tmp, "rb+") as f:
      os.fsync(f.fileno())
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  kill_point("write", path.name)
  os.replace(tmp, path)
  _fsync_dir(path.parent)
  return path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
  """Replaces `path` with `data` (text is UTF-8) atomically (see `save_atomic`)."""
  blob = data.encode() if isinstance(data, str) else data
  if _remote(path):
    from pasta_jax.paths import run_path
    run_path(path).write_bytes(blob)
    return path
  return save_atomic(path, lambda tmp: Path(tmp).write_bytes(blob))


def write_json(path: str | os.PathLike, value, indent: int | None = 1) -> Path:
  return write_atomic(path, json.dumps(value, indent=indent) + "\n")


# --- JSONL ---------------------------------------------------------------------------------------------
def _parses(line: bytes) -> bool:
  try:
    return isinstance(json.loads(line), dict)
  except (ValueError, RecursionError):
    return False


def cut_torn_tail(path: str | os.PathLike) -> bool:
  """Cuts the last line of a JSONL file if a killed writer left it torn (no newline, or not a JSON object).
  Returns whether anything was cut."""
  if _remote(path):
    return False
  path = Path(path)
  try:
    f = open(path, "rb+")
  except OSError:  # no file (nothing to cut), or one this process may only read (its reader skips the torn line)
    return False
  with f:
    size = f.seek(0, os.SEEK_END)
    if size == 0:
      return False
    # the last line starts after the last newline before the final byte (which may be the line's own newline)
    pos, start = size - 1, 0
    while pos > 0:
      begin = max(0, pos - _TAIL_CHUNK)
      f.seek(begin)
      newline = f.read(pos - begin).rfind(b"\n")
      if newline >= 0:
        start = begin + newline + 1
        break
      pos = begin
    f.seek(start)
    last = f.read()
    if last.endswith(b"\n") and _parses(last):
      return False
    f.truncate(start)
    f.flush()
    os.fsync(f.fileno())
    return True


def append_rows(path: str | os.PathLike, rows: Iterable[Mapping]) -> None:
  """Appends JSON rows in one write, after cutting a torn last line; flushed before returning."""
  text = "".join(json.dumps(row) + "\n" for row in rows)
  if not text:
    return
  path = Path(path)
  cut_torn_tail(path)
  with open(path, "a") as f:
    if kill_due("append", path.name):  # what a kill early in the write leaves: half of its first row
      f.write(text[:max(1, text.index("\n") // 2)])
      f.flush()
      die()
    f.write(text)
    f.flush()


def append_row(path: str | os.PathLike, row: Mapping) -> None:
  append_rows(path, [row])


def read_rows(path: str | os.PathLike) -> Iterator[dict]:
  """The complete JSON rows of a JSONL file (none if it does not exist). A torn last line is cut from the file
  (it is what a killed writer left: its row was never done), and other unreadable lines are skipped. For the
  job that owns the file: a reader beside a running writer would cut the row being written."""
  if not _remote(path):
    cut_torn_tail(path)
  from pasta_jax.paths import run_path
  path = run_path(path) if _remote(path) else Path(path)
  if not path.exists():
    return
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except (ValueError, RecursionError):
      continue  # a torn line an older writer left in the middle of the file
    if isinstance(row, dict):
      yield row


def write_rows(path: str | os.PathLike, rows: Iterable[Mapping]) -> None:
  """Replaces a JSONL file atomically."""
  write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


# --- folders -------------------------------------------------------------------------------------------
def _as_path(folder):
  if _remote(folder):
    from pasta_jax.paths import run_path
    return run_path(folder)
  return Path(os.fspath(folder))


def _remove(path) -> None:
  if _remote(path):
    if path.exists():
      path.rmtree()
    return
  path = Path(path)
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path)
  elif path.exists() or path.is_symlink():
    path.unlink()


def is_complete(folder: str | os.PathLike) -> bool:
  """Whether `folder` was published whole (its completion marker, written last, exists)."""
  return (_as_path(folder) / COMPLETE).is_file()


def partial_folder(folder: str | os.PathLike, *, clear: bool = True):
  """The empty folder to write `folder`'s files into before `publish`: a temporary sibling (a leftover of a
  killed writer is cleared), or, on a remote path, `folder` itself, its old content removed."""
  folder = _as_path(folder)
  tmp = folder if _remote(folder) else folder.parent / f".{folder.name}.partial"
  if clear:
    _remove(tmp)
  tmp.mkdir(parents=True, exist_ok=True)
  return tmp


def publish(tmp, folder: str | os.PathLike) -> None:
  """Puts the written `tmp` (from `partial_folder`) in place of `folder`, then writes the marker. A kill before
  the rename leaves the old folder; after it, the new folder without its marker: a resume redoes the export."""
  folder = _as_path(folder)
  if not _remote(folder):
    tmp = Path(tmp)
    kill_point("publish", folder.name)
    old = folder.parent / f".{folder.name}.old"
    _remove(old)
    if folder.exists():
      os.replace(folder, old)  # a folder cannot be renamed over a non-empty one: the old one steps aside first
    kill_point("swap", folder.name)
    os.replace(tmp, folder)
    _fsync_dir(folder.parent)
    kill_point("mark", folder.name)
    write_atomic(folder / COMPLETE, "complete\n")
    _remove(old)
    return
  (folder / COMPLETE).write_text("complete\n")


@contextlib.contextmanager
def publishing(folder: str | os.PathLike):
  """`with publishing(folder) as tmp:` write into tmp; on leaving, tmp is published as `folder` (see `publish`).
  An exception leaves `folder` as it was and removes tmp."""
  tmp = partial_folder(folder)
  try:
    yield tmp
  except BaseException:
    if not _remote(folder):
      _remove(tmp)
    raise
  publish(tmp, folder)


# --- settings of a run ---------------------------------------------------------------------------------
def _plain(value):
  """A value as JSON reads it back (tuples as lists, dataclass dicts as dicts), so saved and current compare."""
  return json.loads(json.dumps(value, default=str))


def changed_fields(saved: Mapping, current: Mapping, *, ignore: Iterable[str] = (),
                   defaults: Mapping | None = None) -> list[tuple[str, object, object]]:
  """(field, saved value, current value) of every field that differs. A field missing from `saved` (a run
  written before the field existed) counts as its value in `defaults` when given."""
  saved, current = _plain(dict(saved)), _plain(dict(current))
  base = _plain(dict(defaults)) if defaults is not None else {}
  skip = set(ignore)
  out = []
  for key in sorted(set(saved) | set(current)):
    if key in skip:
      continue
    old = saved.get(key, base.get(key))
    new = current.get(key, base.get(key))
    if old != new:
      out.append((key, old, new))
  return out


def check_settings(saved: Mapping, current: Mapping, where: str, *, ignore: Iterable[str] = (),
                   defaults: Mapping | None = None, error: type[PastaError] = RunDirError) -> None:
  """Refuses to resume `where` under other settings: `error` naming each changed field, then and now."""
  changed = changed_fields(saved, current, ignore=ignore, defaults=defaults)
  if changed:
    diffs = "; ".join(f"{k}: {old!r} then, {new!r} now" for k, old, new in changed)
    raise error(f"{where} holds a run with other settings ({diffs}); resume with the same settings or use "
                "another folder")


def claim(folder: str | os.PathLike, identity: dict, file_name: str = "run.json", defaults: Mapping | None = None
          ) -> Path:
  """Creates `folder` for this run, or checks that the run already in it has the same identity (a field its
  run file lacks counts as its value in `defaults`: a run from before the field existed)."""
  folder = Path(folder)
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise RunDirError(f"cannot create folder {folder}: {err.strerror}") from None
  run_file = folder / file_name
  if not run_file.exists():
    write_atomic(run_file, json.dumps(identity, indent=2) + "\n")
    return folder
  try:
    previous = json.loads(run_file.read_text())
  except (OSError, ValueError, RecursionError) as err:
    raise RunDirError(f"cannot read {run_file} ({err}); use another folder") from None
  if not isinstance(previous, dict):
    raise RunDirError(f"{run_file} holds no settings object; use another folder")
  check_settings(previous, identity, str(folder), defaults=defaults)
  return folder


# --- JSON and JSONL a user hands us: every failure one line naming the file and line --------------------------
# `json.loads` fails in more ways than `json.JSONDecodeError`: an integer longer than Python's int-string limit
# (4300 digits) raises a plain ValueError, and deep nesting (a line of 100,000 `[`) raises RecursionError.
def parse_json(text: str | bytes, where: str, error: type[PastaError] = PastaError) -> Any:
  """json.loads(text), or `error` naming `where` (e.g. "file.jsonl:12") and what is wrong."""
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise error(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
  except RecursionError:
    raise error(f"{where}: JSON nested too deeply to read") from None
  except UnicodeDecodeError as e:  # bytes that are not UTF-8 (or UTF-16/32)
    raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  except ValueError as e:  # not a decoding error: the int-string limit is the one json.loads can hit
    if "integer string conversion" in str(e):
      raise error(f"{where}: a number with more digits than Python reads "
                  f"({sys.get_int_max_str_digits()})") from None
    raise error(f"{where}: unreadable JSON ({_first_line(e)})") from None


def read_json_file(path: str | os.PathLike, error: type[PastaError] = PastaError) -> Any:
  """The JSON value of a whole file; a missing, unreadable or malformed file is `error` naming it."""
  path = Path(path)
  try:
    text = path.read_text(encoding="utf-8")
  except OSError as e:
    raise error(f"cannot read {path}: {e.strerror or e}") from None
  except UnicodeDecodeError as e:
    raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  return parse_json(text, str(path), error)


def iter_jsonl(path: str | os.PathLike, error: type[PastaError] = PastaError) -> Iterator[tuple[int, Any]]:
  """(1-based line number, value) for every non-blank line of a JSONL file; an unreadable file or line
  (bad JSON, not UTF-8, too deep, too long a number) is `error` naming the file and line."""
  path = Path(path)
  try:
    handle = open(path, "rb")  # lines decoded one by one, so that bad UTF-8 is named by its line
  except OSError as e:
    raise error(f"cannot open data file {path}: {e.strerror or e}") from None
  with handle:
    for line_number, raw in enumerate(handle, start=1):
      where = f"{path}:{line_number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
      if line.strip():
        yield line_number, parse_json(line, where, error)


def _first_line(err: Exception) -> str:
  return (str(err).splitlines() or [type(err).__name__])[0][:200]
