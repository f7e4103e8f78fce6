"""Weight loading: HF folders (single / sharded), GGUF (parser, norms, cache), Orbax checkpoints,
the tokenizer wrapper, config translation, and one clear error per kind of bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.errors import ConfigError, PastaError, WeightsError
from pasta_jax.model import checkpoint, gguf_loader, weights
from pasta_jax.model.config import GemmaConfig, gemma3, get_config
from pasta_jax.model.gemma import Gemma, causal_mask
from pasta_jax.model.load import load_model
from pasta_jax.model.tokenizer import BackendTokenizer, Tokenizer, chat_prompt

# Small and cheap to compile; GQA and the real Gemma 3 pattern (period 6, what a GGUF without a layer
# pattern defaults to) all present: 6 layers, unlike the 3-layer tiny preset.
TINY3 = gemma3("tiny-gemma3", 128, 64, 128, 6, 4, 2, 16, window=8)
TINY1 = dataclasses.replace(get_config("tiny-gemma1"), vocab_size=128)


def random_params(config: GemmaConfig, seed: int = 0, dtype=np.float32) -> dict:
  """Random weights through the HF mapping (norms non-zero so the 1 + w convention shows)."""
  rng = np.random.default_rng(seed)
  state = {name: rng.normal(0, 0.3 if len(shape) == 1 else 0.1, shape).astype(np.float32)
           for name, shape in weights.hf_tensor_shapes(config).items()}
  return weights.params_from_hf(state, config, dtype)


def leaves(params) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_same_params(a, b) -> None:
  la, lb = leaves(a), leaves(b)
  assert la.keys() == lb.keys()
  for key in la:
    assert la[key].dtype == lb[key].dtype, key
    np.testing.assert_array_equal(la[key], lb[key], err_msg=key)


def assert_one_line_error(excinfo, *needles: str) -> str:
  """The message is one line and names the problem. Needles are matched with pytest's temporary
  directories cut down to their last component, so a test's own name ("test_truncated...") in the
  path cannot satisfy them."""
  message = str(excinfo.value)
  assert "\n" not in message, message
  shown = re.sub(r"/\S*pytest-of-\S*/", "<tmp>/", message)
  for needle in needles:
    assert needle in shown, f"{needle!r} not in {shown!r}"
  return message


@pytest.fixture(scope="module")
def tiny3_params():
  return random_params(TINY3)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, tiny3_params):
  """The same tiny model as one model.safetensors and as shards with an index."""
  root = tmp_path_factory.mktemp("hf")
  single = weights.save_hf(root / "single", tiny3_params, TINY3)
  sharded = weights.save_hf(root / "sharded", tiny3_params, TINY3, max_shard_bytes=60_000)
  return single, sharded


# --- HF folders --------------------------------------------------------------------------------------

def test_sharded_folder_equals_single_file(hf_folders, tiny3_params):
  single, sharded = hf_folders
  assert (single / weights.SINGLE_FILE).is_file() and not (single / weights.INDEX_FILE).exists()
  index = json.loads((sharded / weights.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) >= 3
  one, many = load_model(str(single)), load_model(str(sharded))
  assert one.config.name == "single"  # an HF folder's model is named after the folder
  assert dataclasses.replace(one.config, name="") == dataclasses.replace(many.config, name="") \
      == dataclasses.replace(TINY3, name="")
  assert one.tokenizer is None  # a bare test folder has no tokenizer files
  assert_same_params(one.params, many.params)
  assert_same_params(one.params, tiny3_params)


def test_bfloat16_load(hf_folders, tiny3_params):
  single, _ = hf_folders
  loaded = load_model(str(single), dtype=jnp.bfloat16)
  for key, value in leaves(loaded.params).items():
    assert value.dtype == jnp.bfloat16, key
    np.testing.assert_array_equal(value, leaves(tiny3_params)[key].astype(jnp.bfloat16))


def test_bfloat16_export_round_trip(tmp_path, tiny3_params):
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny3_params)
  weights.save_hf(tmp_path, bf16, TINY3)
  assert_same_params(load_model(str(tmp_path), dtype="bfloat16").params, bf16)


def test_multimodal_prefix_and_unknown_tensors(tmp_path, tiny3_params):
  """Gemma 3 multimodal checkpoints nest the text model: vision tensors are skipped, stray text ones
  refused."""
  from safetensors.numpy import save_file
  state = {k.replace("model.", "model.language_model.", 1): v
           for k, v in weights.params_to_hf(tiny3_params, TINY3).items()}
  state["model.vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)
  save_file(state, str(tmp_path / weights.SINGLE_FILE))
  text = weights.config_to_hf(TINY3)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
  assert_same_params(load_model(str(tmp_path)).params, tiny3_params)
  state["model.language_model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
  save_file(state, str(tmp_path / weights.SINGLE_FILE))
  with pytest.raises(WeightsError) as e:
    load_model(str(tmp_path))
  assert_one_line_error(e, "q_proj.bias")


# --- config translation ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma1-2b", "gemma2-9b", "gemma3-270m", "gemma3-4b", "gemma3-27b",
                                  "tiny-gemma2"])
def test_config_round_trip(name):
  config = get_config(name)
  assert weights.config_from_hf(weights.config_to_hf(config), name=name) == config


def test_config_from_legacy_keys():
  """transformers 4.x configs: rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern."""
  legacy = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "vocab_size": 262_208,
            "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131_072}
  config = weights.config_from_hf(legacy, name="gemma3-4b")
  assert config == dataclasses.replace(get_config("gemma3-4b"), vocab_size=262_208)
  multimodal = {"model_type": "gemma3", "text_config": legacy}
  assert weights.config_from_hf(multimodal, name="gemma3-4b") == config


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "llama"}, "llama"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                          "sliding_attention": {"rope_type": "default"}}}, "yarn"),
    ({"layer_types": ["chunked_attention"] * 6}, "chunked_attention"),
    ({"hidden_activation": "relu"}, "relu"),
    ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_config_errors(change, needle):
  with pytest.raises(ConfigError) as e:
    weights.config_from_hf({**weights.config_to_hf(TINY3), **change})
  assert_one_line_error(e, needle)


# --- Orbax checkpoints -------------------------------------------------------------------------------

def _logits(config, params, tokens):
  b, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  return np.asarray(jax.jit(Gemma(config).apply)(params, tokens, positions, causal_mask(b, length)).logits)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
  """A tiny local HF tokenizer with Gemma's special tokens (no hub access needed)."""
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  words = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
           + [f"<unused{i}>" for i in range(60)] + ["user", "model", "hello", "world"])
  raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                               unk_token="<unk>", pad_token="<pad>",
                               additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
  folder = tmp_path_factory.mktemp("tok")
  hf.save_pretrained(folder)
  return Tokenizer.from_hf(folder)


def test_tokenizer_wrapper(word_tokenizer):
  tok = word_tokenizer
  assert tok.encode("hello world") == [2, 68, 69] and tok.encode("hello world", add_bos=False) == [68, 69]
  assert tok.decode([68, 69]) == "hello world"
  assert tok.eos_ids == (1, 5) and tok.bos_id == 2 and tok.pad_id == 0
  assert tok.token_to_id("<unused3>") == 9 and tok.token_to_id("absent") is None
  assert tok.id_to_token(68) == "hello"
  assert chat_prompt("hi") == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
  tags = tok.tag_vocab()
  assert (tags.promise, tags.lengths[0], tags.eos_ids) == (6, 12, (1, 5))


def test_orbax_round_trip_identical_logits(tmp_path, word_tokenizer):
  params = random_params(TINY1, seed=3)
  path = checkpoint.save_checkpoint(tmp_path / "ckpt", params, TINY1, tokenizer=word_tokenizer, step=7)
  loaded = load_model(str(path))
  assert loaded.config == TINY1
  assert_same_params(loaded.params, params)
  tokens = np.random.default_rng(0).integers(0, TINY1.vocab_size, (2, 12)).astype(np.int32)
  np.testing.assert_array_equal(_logits(loaded.config, loaded.params, tokens), _logits(TINY1, params, tokens))
  assert loaded.tokenizer.encode("hello world") == word_tokenizer.encode("hello world")
  assert checkpoint.read_metadata(path)["step"] == 7
  with pytest.raises(WeightsError) as e:  # never clobber a checkpoint by accident
    checkpoint.save_checkpoint(path, params, TINY1)
  assert_one_line_error(e, "not empty")
  checkpoint.save_checkpoint(path, params, TINY1, overwrite=True)  # replaced whole: no stale tokenizer
  assert checkpoint.checkpoint_tokenizer(path) is None and checkpoint.read_metadata(path)["step"] is None
  with pytest.raises(WeightsError) as e:
    checkpoint.save_checkpoint(tmp_path, params, TINY1, overwrite=True)  # holds ckpt/, is not one
  assert_one_line_error(e, "not a pasta checkpoint")


def test_restore_into_other_config_names_both(tmp_path):
  path = checkpoint.save_checkpoint(tmp_path / "ckpt", random_params(TINY1), TINY1)
  other = get_config("tiny-gemma2")
  with pytest.raises(ConfigError) as e:
    checkpoint.restore_checkpoint(path, other)
  assert_one_line_error(e, TINY1.name, other.name, "num_layers 2 vs 4")
  assert checkpoint.checkpoint_tokenizer(path) is None


# --- GGUF ------------------------------------------------------------------------------------------

TINY_WORDS = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "\u2581hello", "wo",
              "rl", "wor", "worl", "world", "\u2581world", "\n", "user", "model"]


def _add_tiny_vocab(writer, vocab_size: int) -> None:
  """A sentencepiece-style Gemma vocabulary as llama.cpp stores it (no merges; specials are CONTROL)."""
  specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
  unused = [f"<unused{i}>" for i in range(vocab_size - len(specials) - len(TINY_WORDS))]
  tokens = specials + unused + TINY_WORDS
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_scores([0.0] * len(tokens))
  writer.add_token_types([3] * (len(specials) + len(unused)) + [1] * len(TINY_WORDS))
  writer.add_bos_token_id(2)
  writer.add_eos_token_id(1)
  writer.add_unk_token_id(3)
  writer.add_pad_token_id(0)


def write_gguf(path, config: GemmaConfig, params, arch: str, quantize: tuple[str, ...] = (),
               vocab: bool = False) -> None:
  """A GGUF as llama.cpp writes Gemma: +1 on every norm, Linear [out, in] layout, no layer pattern.

  quantize: GGUF tensor names to store as Q8_0 (the rest F32). vocab: add a tiny tokenizer.
  """
  import gguf
  inverse = {hf: g for g, hf in gguf_loader._hf_name_map(config.family, config.num_layers).items()}
  writer = gguf.GGUFWriter(str(path), arch)
  if vocab:
    _add_tiny_vocab(writer, config.vocab_size)
  writer.add_name(config.name)
  writer.add_context_length(config.max_position)
  writer.add_embedding_length(config.embed_dim)
  writer.add_feed_forward_length(config.hidden_dim)
  writer.add_block_count(config.num_layers)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_base_global)
  if config.sliding_window:
    writer.add_sliding_window(config.sliding_window)
  for hf_name, array in weights.params_to_hf(params, config).items():
    name = inverse[hf_name]
    array = np.asarray(array, np.float32)
    if name.endswith("norm.weight"):
      array = array + 1.0
    if name in quantize:
      q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
      writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      writer.add_tensor(name, array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny3_params):
  path = tmp_path_factory.mktemp("gguf") / "tiny3.gguf"
  write_gguf(path, TINY3, tiny3_params, "gemma3", quantize=("blk.0.ffn_up.weight",), vocab=True)
  return path


def test_gguf_load_undoes_llama_cpp_conventions(tiny_gguf, tiny3_params, tmp_path):
  config, params = gguf_loader.load_gguf(tiny_gguf, cache_dir=False)
  assert dataclasses.replace(config, name="") == dataclasses.replace(TINY3, name="")
  got, want = leaves(params), leaves(tiny3_params)
  assert got.keys() == want.keys()
  for key in want:
    if "mlp']['up" in key and "layer_0'" in key:  # Q8_0: close, not exact
      np.testing.assert_allclose(got[key], want[key], atol=np.abs(want[key]).max() / 100)
    elif "scale" in key:  # (w + 1) - 1 in float32: rounding only; a missed -1 would be off by 1
      np.testing.assert_allclose(got[key], want[key], atol=1e-6, rtol=0, err_msg=key)
    else:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_gguf_tokenizer_and_its_cache(tiny_gguf, tmp_path):
  fresh = Tokenizer.from_gguf(tiny_gguf, cache_dir=False)
  assert not (tmp_path / "cache").exists()
  built = load_model(str(tiny_gguf), cache_dir=tmp_path / "cache")  # builds and caches it
  assert Tokenizer.from_gguf(tiny_gguf, cache_dir=tmp_path / "cache") is built.tokenizer  # one per process
  Tokenizer._from_gguf_cached.cache_clear()  # a new process: reloaded from the cached files
  cached = Tokenizer.from_gguf(tiny_gguf, cache_dir=tmp_path / "cache")
  assert cached is not built.tokenizer
  assert any(p.name.endswith(f"tokenizer-{__import__('transformers').__version__}")
             for p in (tmp_path / "cache").iterdir())
  for tok in (fresh, built.tokenizer, cached):
    ids = tok.encode("hello world")
    assert ids == [2, tok.token_to_id("hello"), tok.token_to_id("\u2581world")]  # Gemma: no prefix space
    assert tok.decode(ids[1:]) == "hello world"
    assert tok.eos_ids == (1, 5) and tok.tag_vocab().promise == 6
    assert tok.encode_chat("hello") == fresh.encode_chat("hello")


@pytest.fixture(scope="module")
def tokenizer_pair(tiny_gguf, tmp_path_factory):
  """(built from the GGUF by transformers' Gemma class, reloaded fast from the cache's tokenizer.json by the
  `tokenizers` backend alone)."""
  cache = tmp_path_factory.mktemp("tokenizer_cache")
  built = Tokenizer.from_gguf(tiny_gguf, cache_dir=False)
  Tokenizer.from_gguf(tiny_gguf, cache_dir=cache)  # builds and saves the files
  Tokenizer._from_gguf_cached.cache_clear()
  reloaded = Tokenizer.from_gguf(tiny_gguf, cache_dir=cache)
  assert isinstance(reloaded.hf, BackendTokenizer) and not isinstance(built.hf, BackendTokenizer)
  return built, reloaded


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(list("helowrd \n\t<>_xé東") + ["<bos>", "<eos>", "<unused3>", "world"]),
                    max_size=30).map("".join),
       ids=st.lists(st.integers(0, 23), max_size=12))
def test_the_fast_cached_tokenizer_reads_and_writes_as_the_built_one(tokenizer_pair, text, ids):
  built, reloaded = tokenizer_pair
  assert reloaded.encode(text) == built.encode(text)
  assert LangTokenizer(reloaded).encode(text) == LangTokenizer(built).encode(text)  # special spellings as text
  for skip in (False, True):
    assert reloaded.decode(ids, skip_special_tokens=skip) == built.decode(ids, skip_special_tokens=skip)
  assert [reloaded.id_to_token(i) for i in ids] == [built.id_to_token(i) for i in ids]
  assert (reloaded.vocab_size, reloaded.bos_id, reloaded.pad_id, reloaded.eos_ids) == (
      built.vocab_size, built.bos_id, built.pad_id, built.eos_ids)


def test_gguf_tokenizer_without_merges_is_refused(tiny_gguf, tmp_path, monkeypatch):
  """The transformers 5.17 failure: the GGUF's pieces kept, its merges lost, so words fall apart."""
  import transformers
  from tokenizers import Tokenizer as RawTokenizer
  from tokenizers import models, pre_tokenizers

  pieces = ["<unk>"] + TINY_WORDS
  raw = RawTokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
  merge_less = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
  assert merge_less.tokenize(" world") == ["\u2581", "w", "o", "r", "l", "d"]

  class BrokenConversion:
    @staticmethod
    def from_pretrained(*args, **kwargs):
      return merge_less

  monkeypatch.setattr(transformers, "GemmaTokenizerFast", BrokenConversion, raising=False)
  with pytest.raises(WeightsError, match=r"splits 2 of 2 whole-word pieces .*'\u2581hello'"):
    Tokenizer.from_gguf(tiny_gguf, cache_dir=tmp_path / "cache")
  assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing cached


def test_gguf_gemma1_norm_mapping(tmp_path):
  """Gemma 1's ffn_norm is the pre-MLP norm (HF post_attention_layernorm)."""
  params = random_params(TINY1, seed=1)
  write_gguf(tmp_path / "g1.gguf", TINY1, params, "gemma")
  config, loaded = gguf_loader.load_gguf(tmp_path / "g1.gguf", cache_dir=False)
  assert dataclasses.replace(config, name="") == dataclasses.replace(TINY1, name="")
  got, want = leaves(loaded), leaves(params)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], atol=1e-6, rtol=0, err_msg=key)


def test_gguf_cache(tiny_gguf, tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  first = gguf_loader.load_gguf(tiny_gguf, cache_dir=cache)
  files = list(cache.iterdir())
  assert len(files) == 1
  monkeypatch.setattr(gguf_loader, "hf_tensors_from_gguf", lambda *a, **k: pytest.fail("cache hit expected"))
  second = gguf_loader.load_gguf(tiny_gguf, cache_dir=cache)
  assert second[0] == first[0]
  assert_same_params(second[1], first[1])
  bf16 = gguf_loader.load_gguf(tiny_gguf, dtype=jnp.bfloat16, cache_dir=cache)[1]
  assert jax.tree.leaves(bf16)[0].dtype == jnp.bfloat16
  monkeypatch.undo()
  # a cache written under other parsing rules (here: another config) is rebuilt, not trusted
  parse = gguf_loader.config_from_gguf
  renamed = lambda f: dataclasses.replace(parse(f), name="new rules")
  monkeypatch.setattr(gguf_loader, "config_from_gguf", renamed)
  rebuilt = []
  real_tensors = gguf_loader.hf_tensors_from_gguf
  monkeypatch.setattr(gguf_loader, "hf_tensors_from_gguf", lambda *a: rebuilt.append(1) or real_tensors(*a))
  assert gguf_loader.load_gguf(tiny_gguf, cache_dir=cache)[0].name == "new rules" and rebuilt
  monkeypatch.undo()
  os.utime(tiny_gguf, ns=(0, 10**18))  # a rewritten file: new key, the stale entry is replaced
  gguf_loader.load_gguf(tiny_gguf, cache_dir=cache)
  assert [f.name for f in cache.iterdir()] != [f.name for f in files] and len(list(cache.iterdir())) == 1


# --- errors: one line each, naming the problem ------------------------------------------------------

def test_missing_path():
  with pytest.raises(WeightsError) as e:
    load_model("/nonexistent/model.gguf")
  assert_one_line_error(e, "/nonexistent/model.gguf")


def test_unrecognized_folder(tmp_path):
  with pytest.raises(WeightsError) as e:
    load_model(str(tmp_path))
  assert_one_line_error(e, "config.json")


def test_garbage_gguf(tmp_path):
  path = tmp_path / "junk.gguf"
  path.write_bytes(np.random.default_rng(0).bytes(4096))
  with pytest.raises(WeightsError) as e:
    load_model(str(path))
  assert_one_line_error(e, "not a GGUF file")


def test_truncated_gguf(tiny_gguf, tmp_path):
  data = tiny_gguf.read_bytes()
  for cut in (len(data) - 100, len(data) // 2, 300):  # in the tensors, in the tensor data, in the metadata
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(WeightsError) as e:
      load_model(str(path), with_tokenizer=False, cache_dir=False)
    assert_one_line_error(e, "truncated")


def test_gguf_with_garbage_after_header(tiny_gguf, tmp_path):
  data = bytearray(tiny_gguf.read_bytes())
  data[24:] = np.random.default_rng(1).bytes(len(data) - 24)  # keep magic, version and counts
  path = tmp_path / "garbled.gguf"
  path.write_bytes(bytes(data))
  with pytest.raises(WeightsError) as e:
    load_model(str(path), with_tokenizer=False, cache_dir=False)
  assert_one_line_error(e, "garbled.gguf")


def test_gguf_unknown_architecture(tmp_path, tiny3_params):
  path = tmp_path / "llama.gguf"
  write_gguf(path, TINY3, tiny3_params, "llama")
  with pytest.raises(ConfigError) as e:
    load_model(str(path), with_tokenizer=False, cache_dir=False)
  assert_one_line_error(e, "'llama'")


def test_hf_unknown_architecture(hf_folders, tmp_path):
  single, _ = hf_folders
  folder = tmp_path / "other"
  folder.mkdir()
  (folder / weights.SINGLE_FILE).symlink_to(single / weights.SINGLE_FILE)
  (folder / "config.json").write_text(json.dumps({**weights.config_to_hf(TINY3), "model_type": "mistral"}))
  with pytest.raises(ConfigError) as e:
    load_model(str(folder))
  assert_one_line_error(e, "'mistral'")


def test_shape_mismatch_names_tensor(hf_folders, tmp_path):
  single, _ = hf_folders
  folder = tmp_path / "wide"
  folder.mkdir()
  (folder / weights.SINGLE_FILE).symlink_to(single / weights.SINGLE_FILE)
  (folder / "config.json").write_text(json.dumps({**weights.config_to_hf(TINY3), "intermediate_size": 96}))
  with pytest.raises(ConfigError) as e:
    load_model(str(folder))
  assert_one_line_error(e, "model.layers.0.mlp.gate_proj.weight", "[96, 64]", "[128, 64]")


def test_missing_shard_named(hf_folders, tmp_path):
  _, sharded = hf_folders
  folder = tmp_path / "partial"
  folder.mkdir()
  files = sorted(p.name for p in sharded.iterdir())
  shards = [f for f in files if f.endswith(".safetensors")]
  for name in files:
    if name != shards[1]:
      (folder / name).symlink_to(sharded / name)
  with pytest.raises(WeightsError) as e:
    load_model(str(folder))
  assert_one_line_error(e, shards[1], "is missing")


def test_missing_tensor_named(tmp_path, tiny3_params):
  from safetensors.numpy import save_file
  state = weights.params_to_hf(tiny3_params, TINY3)
  del state["model.layers.2.self_attn.k_norm.weight"]
  save_file(state, str(tmp_path / weights.SINGLE_FILE))
  (tmp_path / "config.json").write_text(json.dumps(weights.config_to_hf(TINY3)))
  with pytest.raises(WeightsError) as e:
    load_model(str(tmp_path))
  assert_one_line_error(e, "model.layers.2.self_attn.k_norm.weight")


def test_errors_are_pasta_errors():
  assert issubclass(WeightsError, PastaError) and issubclass(ConfigError, PastaError)
