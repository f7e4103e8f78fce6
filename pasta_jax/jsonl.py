"""Reading JSON and JSONL that a user hands us, with every failure as a one-line PastaError.

`json.loads` fails in more ways than `json.JSONDecodeError`: an integer longer than Python's
int-string limit (4300 digits by default) raises a plain ValueError, and deep nesting (a line of
100,000 `[`) raises RecursionError. Caught one by one, some slip through to a traceback; these
helpers turn each into the caller's error class with the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pasta_jax.errors import PastaError


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
