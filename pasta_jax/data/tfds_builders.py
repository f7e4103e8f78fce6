"""Instruction datasets as TFDS builders writing `array_record`, read back without TensorFlow.

One builder per shared file (lima, alpaca_gpt4_1k, alpaca_5k, alpaca_eval_805, mt_bench) and
`InstructionJsonl` for any JSONL path of the same shapes (`sources.py`). Every example is a
normalized record, all fields text (absent optional fields are stored as "" and dropped on read).

  builder = build("lima", data_dir)                  # prepares once, then reuses the files
  source = data_source("lima", data_dir, "train")    # random access: source[i] -> dict of str

Splits: `train`, plus for the training pools a deterministic `validation` split (2%: the records
whose id hashes smallest, so it does not move when records are appended). Examples keep file order.

Where they live: data_dir/<name>/<config>/1.0.0/, the config being `<file stem>_<hash>`, the hash of
the file's bytes and the build options (max_records, validation fraction). Two different files
(or one file edited) never share prepared data.

No TensorFlow: `download_and_prepare(file_format="array_record")` encodes the features with their
numpy encoders and `as_data_source` / `tfds.data_source` read the array_record files back. The one
TF-free detail here: `_info` builds `tfds.core.DatasetInfo` directly, because the usual
`dataset_info_from_configs` reads metadata files (checksums, citations) from the builder's package
folder, which a builder living in `pasta_jax/data/` does not have; and `code_path` is None (see
`InstructionJsonl`), which keeps tfds from importing `importlib_resources`, a package it needs but
only declares for Python < 3.9.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import tensorflow_datasets as tfds

from pasta_jax.data import sources
from pasta_jax.data.sources import OPTIONAL_FIELDS, RECORD_FIELDS, DataError

FORMAT_VERSION = "1.0.0"  # bump when the stored features or the split rule change
POOL_VALIDATION_FRACTION = 0.02


@dataclasses.dataclass(frozen=True)
class BuildSpec:
  """What one prepared dataset is made from; `config_name` changes whenever any of it does."""

  path: Path
  validation_fraction: float = 0.0
  max_records: int | None = None  # the file's first records only (small test builds)

  def config_name(self) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", self.path.stem.lower()).strip("_") or "data"
    digest = hashlib.sha256(self.path.read_bytes())
    digest.update(json.dumps([FORMAT_VERSION, self.validation_fraction, self.max_records]).encode())
    return f"{slug}_{digest.hexdigest()[:12]}"


class InstructionJsonl(tfds.core.GeneratorBasedBuilder):
  """Any instruction JSONL file, configured by path (see `build`)."""

  name = "instruction_jsonl"
  VERSION = tfds.core.Version(FORMAT_VERSION)
  RELEASE_NOTES = {FORMAT_VERSION: "Normalized instruction records (pasta_jax.data.sources)."}
  SOURCE: str | None = None  # the shared dataset name of a fixed-source builder
  VALIDATION_FRACTION = 0.0
  # TFDS looks for a checksums file next to a builder's code, and for a builder inside a package its
  # lookup touches `importlib_resources`, which tfds only installs for Python < 3.9. Nothing is
  # downloaded here, so there are no checksums: no code path.
  code_path = None

  def __init__(self, *, spec: BuildSpec, **kwargs):
    self.spec = spec
    config = tfds.core.BuilderConfig(name=spec.config_name(), version=FORMAT_VERSION,
                                     description=f"{spec.path} (max_records={spec.max_records})")
    kwargs.pop("config", None)  # unpickling passes the stored state back: the spec decides the config
    super().__init__(config=config, file_format="array_record", **kwargs)
    self._original_state = dict(self._original_state, spec=spec)

  def _info(self) -> tfds.core.DatasetInfo:
    features = tfds.features.FeaturesDict({field: tfds.features.Text() for field in RECORD_FIELDS})
    # disable_shuffling: examples are written in key order (the line order), not hashed order.
    return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True,
                                 description=f"Instruction records from {self.spec.path.name}.")

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download: the file is local
    records = sources.read_records(self.spec.path, self.spec.max_records)
    held_out = validation_ids(records, self.spec.validation_fraction)
    splits = {"train": self._generate_examples([r for r in records if r["id"] not in held_out])}
    if held_out:
      splits["validation"] = self._generate_examples([r for r in records if r["id"] in held_out])
    return splits

  def _generate_examples(self, records):
    for index, record in enumerate(records):
      yield index, {field: record.get(field, "") for field in RECORD_FIELDS}


class Lima(InstructionJsonl):
  name = "lima"
  SOURCE = "lima"
  VALIDATION_FRACTION = POOL_VALIDATION_FRACTION


class AlpacaGpt41k(InstructionJsonl):
  name = "alpaca_gpt4_1k"
  SOURCE = "alpaca_gpt4_1k"
  VALIDATION_FRACTION = POOL_VALIDATION_FRACTION


class Alpaca5k(InstructionJsonl):
  name = "alpaca_5k"
  SOURCE = "alpaca_5k"
  VALIDATION_FRACTION = POOL_VALIDATION_FRACTION


class AlpacaEval805(InstructionJsonl):
  name = "alpaca_eval_805"
  SOURCE = "alpaca_eval_805"


class MtBench(InstructionJsonl):
  name = "mt_bench"
  SOURCE = "mt_bench"


BUILDERS: dict[str, type[InstructionJsonl]] = {cls.SOURCE: cls for cls in
                                               (Lima, AlpacaGpt41k, Alpaca5k, AlpacaEval805, MtBench)}


def validation_ids(records: Sequence[dict], fraction: float) -> set[str]:
  """Ids of the held-out records: round(fraction * n) of them (at least one if fraction > 0 and n > 1),
  those whose id hashes smallest. Hashing ids, not positions, keeps the split stable as a file grows."""
  if fraction <= 0 or len(records) < 2:
    return set()
  count = min(len(records) - 1, max(1, math.floor(fraction * len(records) + 0.5)))
  by_hash = sorted(records, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
  return {r["id"] for r in by_hash[:count]}


def make_builder(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None, *,
                 max_records: int | None = None, validation_fraction: float | None = None) -> InstructionJsonl:
  """The builder for a shared dataset name or a JSONL path (nothing prepared yet)."""
  if max_records is not None and max_records < 1:
    raise DataError(f"max_records must be at least 1, got {max_records}")
  cls = BUILDERS.get(str(name_or_path), InstructionJsonl)
  fraction = cls.VALIDATION_FRACTION if validation_fraction is None else validation_fraction
  if not 0 <= fraction < 1:
    raise DataError(f"validation_fraction must be in [0, 1), got {fraction}")
  spec = BuildSpec(sources.resolve_path(name_or_path), fraction, max_records)
  return cls(spec=spec, data_dir=None if data_dir is None else os.fspath(data_dir))


def build(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None, *, max_records: int | None = None,
          validation_fraction: float | None = None) -> InstructionJsonl:
  """The prepared builder (array_record files written on first use, reused after).

  name_or_path: lima, alpaca_gpt4_1k, alpaca_5k, alpaca_eval_805, mt_bench, or a JSONL path.
  validation_fraction: default 2% for the training pools, 0 (no validation split) otherwise.
  """
  builder = make_builder(name_or_path, data_dir, max_records=max_records, validation_fraction=validation_fraction)
  builder.download_and_prepare()
  return builder


def data_source(name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None, split: str = "train", *,
                max_records: int | None = None, validation_fraction: float | None = None) -> RecordSource:
  """Random access to one split (TFDS split syntax, e.g. "train[:10%]"), records as dicts of str."""
  builder = build(name_or_path, data_dir, max_records=max_records, validation_fraction=validation_fraction)
  base = split.split("[", 1)[0]
  if base not in builder.info.splits:
    raise DataError(f"{builder.info.full_name} has no split {base!r} (splits: {', '.join(builder.info.splits)})")
  # = tfds.data_source(builder.info.full_name, data_dir=...), minus the lookup that finds this builder again.
  return RecordSource(builder.as_data_source(split=split))


class RecordSource(Sequence):
  """A TFDS array_record data source with its bytes decoded: source[i] is a normalized record."""

  def __init__(self, source):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> dict[str, str]:
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    if not -len(self) <= index < len(self):
      raise IndexError(f"record {index} out of range for a source of {len(self)}")
    return decode_record(self.source[index % len(self)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, str]]:
    return [self[i] for i in indices]

  def __repr__(self) -> str:
    return f"RecordSource({self.source!r})"


def decode_record(example: dict) -> dict[str, str]:
  """Stored example (bytes) -> normalized record (str; empty optional fields dropped)."""
  record = {key: value.decode("utf-8") if isinstance(value, bytes) else str(value) for key, value in example.items()}
  return {key: value for key, value in record.items() if key not in OPTIONAL_FIELDS or value}
