"""TFDS builders writing array_record, read back without TensorFlow through `tfds.data_source`."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys

import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from pasta_jax.data import sources, tfds_builders  # noqa: E402
from pasta_jax.data.sources import DataError, read_records  # noqa: E402
from pasta_jax.data.tfds_builders import build, data_source  # noqa: E402

SHARED = sources.shared_data_dir()
needs_shared = pytest.mark.skipif(not (SHARED / "lima.jsonl").is_file(), reason="../shared/data is not here")

UNICODE_ROWS = [
    {"id": 3, "instruction": "Café ✓ 中文 🙂", "input": "tab\there\nnewline", "output": "naïve — “quotes” \\ \"x\""},
    {"id": "b", "instruction": "List", "output": "- a\n- b", "annotated": 'A<promise topic="é" tokens="10"/>'
     '<async>x</async><sync/>B', "reference": "réf"},
    {"id": "c", "instruction": "Zero width\u200b and NUL-free", "input": "", "output": ""},
]


def write_jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
  return str(path)


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is not None, reason="TensorFlow is installed here")
def test_tensorflow_is_not_needed(tmp_path):
  build(write_jsonl(tmp_path / "x.jsonl", UNICODE_ROWS), tmp_path / "tfds")
  assert "tensorflow" not in sys.modules


def test_generic_round_trip_is_exact(tmp_path):
  path = write_jsonl(tmp_path / "mine.jsonl", UNICODE_ROWS)
  source = data_source(path, tmp_path / "tfds", "train")
  assert list(source) == read_records(path)  # same order, unicode, optional fields absent where absent
  assert source[-1] == source[2]
  with pytest.raises(IndexError):
    source[3]
  assert isinstance(source[0]["id"], str)


def test_tfds_data_source_reads_the_same_files(tmp_path):
  path = write_jsonl(tmp_path / "mine.jsonl", UNICODE_ROWS)
  builder = build(path, tmp_path / "tfds")
  name = f"{builder.name}/{builder.builder_config.name}:{builder.version}"
  raw = tfds.data_source(name, data_dir=str(tmp_path / "tfds"), split="train")
  assert [tfds_builders.decode_record(raw[i]) for i in range(len(raw))] == read_records(path)


@needs_shared
def test_real_lima_through_the_generic_builder(tmp_path):
  source = data_source(SHARED / "lima.jsonl", tmp_path / "tfds", "train")
  assert len(source) == 1029
  assert source[1028] == read_records("lima")[1028]


@needs_shared
@pytest.mark.parametrize("name", list(sources.SHARED_FILES))
def test_each_shared_builder(tmp_path, name):
  builder = build(name, tmp_path / "tfds", max_records=60)
  assert builder.name == name
  expected = read_records(name, max_records=60)
  train = list(data_source(name, tmp_path / "tfds", "train", max_records=60))
  if name in sources.TRAINING_POOLS:
    validation = list(data_source(name, tmp_path / "tfds", "validation", max_records=60))
    assert len(validation) == 1  # 2% of 60, rounded
    assert sorted(train + validation, key=expected.index) == expected
    assert train == [r for r in expected if r not in validation]  # file order kept
  else:
    assert set(builder.info.splits) == {"train"}
    assert train == expected


@needs_shared
def test_lima_pool_split_is_two_percent_and_stable(tmp_path):
  builder = build("lima", tmp_path / "tfds")
  assert {k: v.num_examples for k, v in builder.info.splits.items()} == {"train": 1008, "validation": 21}
  first = [r["id"] for r in data_source("lima", tmp_path / "tfds", "validation")]
  again = [r["id"] for r in data_source("lima", tmp_path / "other", "validation")]
  assert first == again
  assert set(first).isdisjoint(r["id"] for r in data_source("lima", tmp_path / "tfds", "train"))


def test_different_contents_never_collide(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  one = write_jsonl(tmp_path / "a" / "data.jsonl", UNICODE_ROWS[:1])
  two = write_jsonl(tmp_path / "b" / "data.jsonl", UNICODE_ROWS[1:])
  data_dir = tmp_path / "tfds"
  first, second = build(one, data_dir), build(two, data_dir)
  assert first.builder_config.name != second.builder_config.name
  assert first.data_dir != second.data_dir
  assert list(data_source(one, data_dir)) == read_records(one)
  assert list(data_source(two, data_dir)) == read_records(two)
  # The same file (and options) reuses its prepared data; other options get their own.
  assert build(one, data_dir).data_dir == first.data_dir
  assert build(two, data_dir, max_records=1).data_dir != second.data_dir
  assert build(two, data_dir, validation_fraction=0.5).data_dir != second.data_dir


def test_generic_validation_fraction(tmp_path):
  rows = [{"id": i, "instruction": f"q{i}", "output": f"a{i}"} for i in range(10)]
  path = write_jsonl(tmp_path / "ten.jsonl", rows)
  train = data_source(path, tmp_path / "tfds", "train", validation_fraction=0.2)
  validation = data_source(path, tmp_path / "tfds", "validation", validation_fraction=0.2)
  assert (len(train), len(validation)) == (8, 2)
  assert len(data_source(path, tmp_path / "tfds", "train[:50%]", validation_fraction=0.2)) == 4


def test_source_pickles(tmp_path):
  source = data_source(write_jsonl(tmp_path / "x.jsonl", UNICODE_ROWS), tmp_path / "tfds")
  assert list(pickle.loads(pickle.dumps(source))) == list(source)


def test_errors(tmp_path):
  path = write_jsonl(tmp_path / "x.jsonl", UNICODE_ROWS)
  with pytest.raises(DataError, match="has no split 'validation' \\(splits: train\\)"):
    data_source(path, tmp_path / "tfds", "validation")
  with pytest.raises(DataError, match="no such data file"):
    build(tmp_path / "missing.jsonl", tmp_path / "tfds")
  with pytest.raises(DataError, match="max_records must be at least 1"):
    build(path, tmp_path / "tfds", max_records=0)
  with pytest.raises(DataError, match="validation_fraction must be in"):
    build(path, tmp_path / "tfds", validation_fraction=1.0)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": 1, "instruction": "a", "output": "b"}\n{oops\n')
  with pytest.raises(DataError, match="bad.jsonl:2: bad JSON"):
    build(bad, tmp_path / "tfds")
