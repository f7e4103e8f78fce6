"""Instruction JSONL files -> normalized records, one reader for every shape the project uses.

A normalized record is a dict of str:
  id, instruction, input, output     always present ("" where the file has nothing)
  reference                          optional: the answer an evaluation compares against
  annotated                          optional: a promise-form PASTA-LANG answer
Optional fields are absent rather than "" (so `record.get("annotated")` means "has one").

Shapes, told apart per line by their fields:
  alpaca       id, instruction, output, optional input / reference / annotated
               (lima.jsonl, alpaca_gpt4_1k.jsonl, alpaca_5k.jsonl, and any file like them)
  alpaca_eval  id, instruction, reference_output: output and reference <- reference_output
  mt_bench     question_id, turns: instruction <- turns[0] (the first turn), reference <- reference[0]
Ids become strings and must be unique in a file.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pasta_jax.errors import PastaError
from pasta_jax.model import runfiles

FIELDS = ("id", "instruction", "input", "output")
OPTIONAL_FIELDS = ("reference", "annotated")
RECORD_FIELDS = FIELDS + OPTIONAL_FIELDS

# The shared files by dataset name (DESIGN section 7). PASTA_SHARED_DATA overrides where they live.
SHARED_FILES = {
  "lima": "lima.jsonl",
  "alpaca_gpt4_1k": "alpaca_gpt4_1k.jsonl",
  "alpaca_5k": "alpaca_5k.jsonl",
  "alpaca_eval_805": "alpaca_eval_805.jsonl",
  "mt_bench": "mt_bench_questions.jsonl",
}
TRAINING_POOLS = ("lima", "alpaca_gpt4_1k", "alpaca_5k")


class DataError(PastaError):
  """A data file that cannot be read as instruction records; the message names file and line."""


def shared_data_dir() -> Path:
  """`../shared/data` next to the checkout (the project layout), unless PASTA_SHARED_DATA says otherwise."""
  override = os.environ.get("PASTA_SHARED_DATA")
  return Path(override) if override else Path(__file__).resolve().parents[3] / "shared" / "data"


def resolve_path(name_or_path: str | os.PathLike) -> Path:
  """A shared dataset name (see SHARED_FILES) or a JSONL path -> the file's path."""
  key = str(name_or_path)
  if key in SHARED_FILES:
    return shared_data_dir() / SHARED_FILES[key]
  path = Path(key)
  if not path.is_file():
    names = ", ".join(SHARED_FILES)
    raise DataError(f"no such data file: {path} (give a .jsonl path or one of: {names})")
  return path


def dataset_name(name_or_path: str | os.PathLike) -> str:
  """A short name for reports: the shared name, or the file's stem."""
  key = str(name_or_path)
  return key if key in SHARED_FILES else Path(key).stem


def read_records(name_or_path: str | os.PathLike, max_records: int | None = None) -> list[dict[str, str]]:
  """Every record of a JSONL file (or shared dataset name), normalized; the first `max_records` if given."""
  path = resolve_path(name_or_path)
  records: list[dict[str, str]] = []
  first_line: dict[str, int] = {}
  for line_number, raw in iter_json_lines(path):
    if max_records is not None and len(records) >= max_records:
      break
    where = f"{path}:{line_number}"
    record = normalize(raw, where)
    if record["id"] in first_line:
      raise DataError(f"{where}: id {record['id']!r} repeats the id of line {first_line[record['id']]}")
    first_line[record["id"]] = line_number
    records.append(record)
  return records


def iter_json_lines(path: Path) -> Iterator[tuple[int, dict]]:
  """(1-based line number, object) for every non-blank line; any line that is no readable JSON object
  (bad JSON, not UTF-8, nested too deeply, a number too long for Python) is a DataError naming it."""
  for line_number, value in runfiles.iter_jsonl(path, DataError):
    if not isinstance(value, dict):
      raise DataError(f"{path}:{line_number}: expected a JSON object, got {type(value).__name__}")
    yield line_number, value


def normalize(raw: Mapping[str, Any], where: str) -> dict[str, str]:
  """One JSON object (any known shape) -> a normalized record. `where` ("file:line") prefixes errors."""
  if "turns" in raw or "question_id" in raw:
    record = _from_mt_bench(raw, where)
  elif "reference_output" in raw:
    record = _from_alpaca_eval(raw, where)
  else:
    record = _from_alpaca(raw, where)
  if not record["instruction"].strip():
    raise DataError(f"{where}: field 'instruction' is empty")
  for key, value in record.items():
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape such as \ud800: valid JSON, but no text
      raise DataError(f"{where}: field {key!r} holds an unpaired surrogate at character {e.start}") from None
  return {key: value for key, value in record.items() if key in FIELDS or value}


def _from_alpaca(raw: Mapping[str, Any], where: str) -> dict[str, str]:
  if "output" not in raw and "annotated" not in raw:
    raise DataError(f"{where}: missing field 'output' (an instruction record needs id, instruction, output)")
  return {"id": _id(raw, "id", where), "instruction": _text(raw, "instruction", where),
          "input": _text(raw, "input", where, default=""), "output": _text(raw, "output", where, default=""),
          "reference": _text(raw, "reference", where, default=""),
          "annotated": _text(raw, "annotated", where, default="")}


def _from_alpaca_eval(raw: Mapping[str, Any], where: str) -> dict[str, str]:
  reference = _text(raw, "reference_output", where)
  return {"id": _id(raw, "id", where), "instruction": _text(raw, "instruction", where), "input": "",
          "output": reference, "reference": reference}


def _from_mt_bench(raw: Mapping[str, Any], where: str) -> dict[str, str]:
  turns = _first_of_list(raw, "turns", where, required=True)
  reference = _first_of_list(raw, "reference", where, required=False)
  return {"id": _id(raw, "question_id", where), "instruction": turns, "input": "", "output": "",
          "reference": reference}


def _id(raw: Mapping[str, Any], field: str, where: str) -> str:
  if field not in raw:
    raise DataError(f"{where}: missing field {field!r}")
  value = raw[field]
  if isinstance(value, bool) or not isinstance(value, int | str) or str(value) == "":
    raise DataError(f"{where}: field {field!r} must be a non-empty string or an integer, got {reprlib.repr(value)}")
  return str(value)


def _text(raw: Mapping[str, Any], field: str, where: str, default: str | None = None) -> str:
  if field not in raw or raw[field] is None:
    if default is None:
      raise DataError(f"{where}: missing field {field!r}")
    return default
  if not isinstance(raw[field], str):
    raise DataError(f"{where}: field {field!r} must be a string, got {type(raw[field]).__name__}")
  return raw[field]


def _first_of_list(raw: Mapping[str, Any], field: str, where: str, required: bool) -> str:
  value = raw.get(field)
  if value is None and not required:
    return ""
  if not isinstance(value, list) or not value or not isinstance(value[0], str):
    raise DataError(f"{where}: field {field!r} must be a non-empty list of strings")
  return value[0]
