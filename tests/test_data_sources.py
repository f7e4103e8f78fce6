"""Instruction JSONL reader: the five shared files' shapes, any file of the same shape, and its errors."""

from __future__ import annotations

import json

import pytest

from pasta_jax.data import sources
from pasta_jax.data.sources import DataError, read_records
from pasta_jax.errors import PastaError

SHARED = sources.shared_data_dir()
needs_shared = pytest.mark.skipif(not (SHARED / "lima.jsonl").is_file(), reason="../shared/data is not here")


def write_jsonl(path, rows) -> str:
  path.write_text("".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
                          for row in rows), encoding="utf-8")
  return str(path)


def raw_rows(name: str) -> list[dict]:
  with open(SHARED / sources.SHARED_FILES[name], encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@needs_shared
@pytest.mark.parametrize("name, rows", [("lima", 1029), ("alpaca_gpt4_1k", 999), ("alpaca_5k", 5000)])
def test_training_pools_read_as_is(name, rows):
  records = read_records(name)
  raw = raw_rows(name)
  assert len(records) == rows
  for record, row in zip(records, raw):
    assert record == {"id": str(row["id"]), "instruction": row["instruction"], "input": row["input"],
                      "output": row["output"]}


@needs_shared
def test_lima_by_path_equals_by_name():
  assert read_records(SHARED / "lima.jsonl") == read_records("lima")


@needs_shared
def test_alpaca_eval_answer_is_the_reference():
  records, raw = read_records("alpaca_eval_805"), raw_rows("alpaca_eval_805")
  assert len(records) == 805
  for record, row in zip(records, raw):
    assert record["output"] == record["reference"] == row["reference_output"]
    assert record["instruction"] == row["instruction"] and record["input"] == ""


@needs_shared
def test_mt_bench_takes_the_first_turn():
  records, raw = read_records("mt_bench"), raw_rows("mt_bench")
  assert len(records) == 80
  for record, row in zip(records, raw):
    assert record["id"] == str(row["question_id"])
    assert record["instruction"] == row["turns"][0]
    assert record["output"] == "" and record["input"] == ""
    assert record.get("reference") == ((row["reference"][0] or None) if "reference" in row else None)


def test_any_file_of_the_same_shape(tmp_path):
  path = write_jsonl(tmp_path / "mine.jsonl", [
      {"id": 7, "instruction": "Say hi ✓", "output": "hi 中文 🙂"},
      "",  # blank lines are skipped
      {"id": "b", "instruction": "List", "input": "x", "output": "- a\n- b", "annotated": "A<sync/>B",
       "reference": "ref", "extra": 1},
      {"id": "c", "instruction": "Empty optionals", "output": "o", "annotated": "", "reference": None},
  ])
  assert read_records(path) == [
      {"id": "7", "instruction": "Say hi ✓", "input": "", "output": "hi 中文 🙂"},
      {"id": "b", "instruction": "List", "input": "x", "output": "- a\n- b", "reference": "ref",
       "annotated": "A<sync/>B"},
      {"id": "c", "instruction": "Empty optionals", "input": "", "output": "o"},
  ]
  assert read_records(path, max_records=2) == read_records(path)[:2]
  assert sources.dataset_name(path) == "mine" and sources.dataset_name("lima") == "lima"


def test_annotated_alone_is_enough(tmp_path):
  path = write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "instruction": "i", "annotated": "A<sync/>B"}])
  assert read_records(path) == [{"id": "1", "instruction": "i", "input": "", "output": "", "annotated": "A<sync/>B"}]


@pytest.mark.parametrize("rows, message", [
    (['{"id": 1, "instruction": "a", "output": "b"}', '{"id": 2, "instruction": '], r"bad\.jsonl:2: bad JSON"),
    (['[1, 2]'], r"bad\.jsonl:1: expected a JSON object, got list"),
    ([{"id": 1, "output": "b"}], r"bad\.jsonl:1: missing field 'instruction'"),
    ([{"id": 1, "instruction": "a"}], r"bad\.jsonl:1: missing field 'output'"),
    ([{"instruction": "a", "output": "b"}], r"bad\.jsonl:1: missing field 'id'"),
    ([{"id": 1, "instruction": "a", "output": 3}], r"bad\.jsonl:1: field 'output' must be a string, got int"),
    ([{"id": 1, "instruction": "  ", "output": "b"}], r"bad\.jsonl:1: field 'instruction' is empty"),
    ([{"id": [1], "instruction": "a", "output": "b"}], r"bad\.jsonl:1: field 'id' must be"),
    ([{"id": 1, "instruction": "a", "output": "b"}, {"id": "1", "instruction": "c", "output": "d"}],
     r"bad\.jsonl:2: id '1' repeats the id of line 1"),
    ([{"question_id": 1, "category": "x"}], r"bad\.jsonl:1: field 'turns' must be a non-empty list"),
    ([{"id": 1, "instruction": "a", "reference_output": None}], r"bad\.jsonl:1: missing field 'reference_output'"),
])
def test_errors_name_file_line_and_field(tmp_path, rows, message):
  path = write_jsonl(tmp_path / "bad.jsonl", rows)
  with pytest.raises(DataError, match=message):
    read_records(path)


def test_missing_file_and_unknown_name(tmp_path):
  with pytest.raises(PastaError, match="no such data file: .*nope.jsonl"):
    read_records(tmp_path / "nope.jsonl")
  with pytest.raises(DataError, match="one of: lima, alpaca_gpt4_1k"):
    read_records("not_a_dataset")


def test_not_utf8(tmp_path):
  path = tmp_path / "latin.jsonl"
  path.write_bytes(b'{"id": 1, "instruction": "caf\xe9", "output": "x"}\n')
  with pytest.raises(DataError, match="not UTF-8"):
    read_records(path)


def test_shared_dir_override(tmp_path, monkeypatch):
  write_jsonl(tmp_path / "lima.jsonl", [{"id": 1, "instruction": "a", "output": "b"}])
  monkeypatch.setenv("PASTA_SHARED_DATA", str(tmp_path))
  assert read_records("lima") == [{"id": "1", "instruction": "a", "input": "", "output": "b"}]
