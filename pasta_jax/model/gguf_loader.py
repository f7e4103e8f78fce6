"""GGUF (llama.cpp) Gemma files -> GemmaConfig + our parameter tree, dequantized.

Reading: a small GGUF parser of our own. `gguf.GGUFReader` builds a numpy view per metadata
element and needs ~15 s for the 262k-token vocabulary of Gemma 3; walking the same bytes with
`struct` takes well under a second, and lets every malformed file fail with one clear line.
Tensors are dequantized with `gguf.quants.dequantize`.

Conventions of llama.cpp's Gemma conversion that we undo:
  * every `*norm.weight` is stored with +1 already added (llama.cpp multiplies by w, Gemma by 1+w);
  * dims are listed fastest-first, so a [D, F] GGUF tensor is a numpy [F, D] array: exactly the
    torch Linear layout [out, in] of Hugging Face, so the HF mapping in `weights.py` applies as is;
  * older files have no layer pattern or local RoPE base: Gemma 3 defaults (every 6th layer
    global, local base 10000) as in llama.cpp and transformers; newer keys are read when present.

The dequantized float32 tree is cached (safetensors, keyed by the file's size and mtime, checked
against the config parsed from the header) so the second load of a model skips dequantizing.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import ConfigError, WeightsError
from pasta_jax.model import weight_file, weights
from pasta_jax.model.config import GemmaConfig, config_from_dict, config_to_dict

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
CACHE_FORMAT = 2  # bump when the cached layout changes
CACHE_SUFFIX = ".weights"  # a `weight_file`
_SUPPORTED_VERSIONS = (2, 3)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_FAMILY_OF_ARCH = {"gemma": "gemma1", "gemma2": "gemma2", "gemma3": "gemma3"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  shape: tuple[int, ...]  # numpy order (slowest first): GGUF's dims reversed
  ggml_type: int
  offset: int  # absolute byte offset in the file
  nbytes: int


@dataclasses.dataclass(frozen=True)
class GGUFFile:
  path: Path
  version: int
  metadata: dict[str, Any]  # string arrays are left as their length (int) unless asked for
  tensors: dict[str, TensorInfo]


class _Cursor:
  """Bounds-checked little-endian reads over the mapped file."""

  def __init__(self, buf, path: Path):
    self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

  def need(self, n: int, what: str) -> int:
    if n < 0 or self.pos + n > self.size:
      raise WeightsError(f"truncated or corrupt GGUF {self.path}: {what} needs {n} bytes at offset "
                         f"{self.pos}, file has {self.size}")
    start = self.pos
    self.pos += n
    return start

  def scalar(self, fmt: str, what: str):
    start = self.need(struct.calcsize(fmt), what)
    return struct.unpack_from(fmt, self.buf, start)[0]

  def string(self, what: str) -> str:
    n = self.scalar("<Q", what)
    start = self.need(n, what)
    try:
      return bytes(self.buf[start:start + n]).decode("utf-8")
    except UnicodeDecodeError:
      raise WeightsError(f"corrupt GGUF {self.path}: {what} at offset {start} is not UTF-8") from None

  def skip_string(self, what: str) -> None:
    self.need(self.scalar("<Q", what), what)

  def value(self, vtype: int, key: str, keep_strings: bool):
    if vtype in _SCALARS:
      return self.scalar(_SCALARS[vtype], key)
    if vtype == _STRING:
      return self.string(key)
    if vtype != _ARRAY:
      raise WeightsError(f"corrupt GGUF {self.path}: metadata {key!r} has unknown value type {vtype}")
    item_type, count = self.scalar("<I", key), self.scalar("<Q", key)
    if item_type in _NUMPY:
      dtype = np.dtype(_NUMPY[item_type])
      start = self.need(count * dtype.itemsize, key)
      return np.frombuffer(self.buf, dtype, count, start).copy()
    if item_type == _STRING:
      if keep_strings:
        return [self.string(key) for _ in range(count)]
      for _ in range(count):  # walk, don't decode: only the count is kept
        self.skip_string(key)
      return count
    raise WeightsError(f"corrupt GGUF {self.path}: metadata {key!r} is an array of unknown type {item_type}")


def _tensor_nbytes(path: Path, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
  try:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
  except (ValueError, KeyError):
    raise WeightsError(f"corrupt GGUF {path}: tensor {name} has unknown type {ggml_type}") from None
  if dims and dims[0] % block:
    raise WeightsError(f"corrupt GGUF {path}: tensor {name} row of {dims[0]} is not a multiple of {block}")
  return int(np.prod(dims, dtype=np.int64)) // block * type_size


def read_gguf(path: str | os.PathLike, keep_strings: tuple[str, ...] = ()) -> GGUFFile:
  """Parse a GGUF header: metadata and tensor directory. Raises WeightsError on a malformed file.

  keep_strings: metadata keys whose string arrays to decode (others keep only their length).
  """
  path = Path(path)
  if not path.is_file():
    raise WeightsError(f"no such GGUF file: {path}")
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size < 24:
      raise WeightsError(f"truncated GGUF {path}: {size} bytes is shorter than a GGUF header")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  try:
    return _parse(buf, path, keep_strings)
  finally:
    buf.close()


def _parse(buf, path: Path, keep_strings: tuple[str, ...]) -> GGUFFile:
  cur = _Cursor(buf, path)
  if bytes(buf[:4]) != GGUF_MAGIC:
    raise WeightsError(f"not a GGUF file: {path} (starts with {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
  cur.pos = 4
  version = cur.scalar("<I", "version")
  if version not in _SUPPORTED_VERSIONS:
    raise WeightsError(f"unsupported or corrupt GGUF {path}: version {version} "
                       f"(supported: {_SUPPORTED_VERSIONS})")
  num_tensors, num_kv = cur.scalar("<Q", "tensor count"), cur.scalar("<Q", "metadata count")
  if num_tensors > cur.size or num_kv > cur.size:  # each entry takes bytes: garbage counts
    raise WeightsError(f"truncated or corrupt GGUF {path}: {num_tensors} tensors / {num_kv} metadata "
                       f"entries in {cur.size} bytes")
  metadata: dict[str, Any] = {}
  for _ in range(num_kv):
    key = cur.string("metadata key")
    metadata[key] = cur.value(cur.scalar("<I", key), key, key in keep_strings)
  infos = []
  for _ in range(num_tensors):
    name = cur.string("tensor name")
    n_dims = cur.scalar("<I", name)
    if not 1 <= n_dims <= 4:
      raise WeightsError(f"corrupt GGUF {path}: tensor {name} has {n_dims} dims")
    dims = tuple(cur.scalar("<Q", name) for _ in range(n_dims))
    infos.append((name, dims, cur.scalar("<I", name), cur.scalar("<Q", name)))
  alignment = int(metadata.get("general.alignment", 32))
  data_start = -(-cur.pos // alignment) * alignment
  tensors = {}
  for name, dims, ggml_type, offset in infos:
    nbytes = _tensor_nbytes(path, name, dims, ggml_type)
    start = data_start + offset
    if start + nbytes > cur.size:
      raise WeightsError(f"truncated GGUF {path}: tensor {name} needs bytes up to {start + nbytes}, "
                         f"file has {cur.size}")
    tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
  return GGUFFile(path, version, metadata, tensors)


# --- config ----------------------------------------------------------------------------------------

def config_from_gguf(file: GGUFFile) -> GemmaConfig:
  meta = file.metadata
  arch = meta.get("general.architecture")
  family = _FAMILY_OF_ARCH.get(arch)
  if family is None:
    raise ConfigError(f"unknown architecture {arch!r} in {file.path.name}; "
                      f"supported: {', '.join(_FAMILY_OF_ARCH)}")

  def get(key: str, default=None):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
      raise ConfigError(f"GGUF {file.path.name} lacks {arch}.{key}")
    return value

  embed = file.tensors.get("token_embd.weight")
  if embed is None:
    raise WeightsError(f"GGUF {file.path.name} has no token_embd.weight")
  d, layers, heads = int(get("embedding_length")), int(get("block_count")), int(get("attention.head_count"))
  kv_heads = get("attention.head_count_kv", heads)
  if isinstance(kv_heads, np.ndarray):  # per-layer list in some files; Gemma's are uniform
    kv_heads = int(kv_heads.max())
  head_dim = int(get("attention.key_length", d // heads))
  base = _f32(get("rope.freq_base", 10_000.0))
  if family == "gemma1":
    kinds, qpas, window, base_l, scale = ("global",) * layers, head_dim, None, base, 1.0
  else:
    # llama.cpp scales 27B queries by (d / heads)**-0.5 rather than head_dim**-0.5 (HF: query_pre_attn_scalar)
    qpas = d // heads if layers == {"gemma2": 46, "gemma3": 62}[family] else head_dim
    window = int(get("attention.sliding_window", 4096))
    kinds = _gguf_layer_kinds(meta.get(f"{arch}.attention.sliding_window_pattern"), layers,
                              6 if family == "gemma3" else 2)
    base_l = _f32(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)) if family == "gemma3" else base
    scale = 1.0
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if family == "gemma3" and scaling not in ("none", ""):
      if scaling != "linear":
        raise ConfigError(f"unsupported rope scaling {scaling!r} in {file.path.name}")
      scale = _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))
  caps = (meta.get(f"{arch}.attn_logit_softcapping"), meta.get(f"{arch}.final_logit_softcapping"))
  if family == "gemma2":
    caps = (caps[0] or 50.0, caps[1] or 30.0)
  later = family != "gemma1"
  try:
    return GemmaConfig(
        family=family, name=str(meta.get("general.name", file.path.stem)), vocab_size=embed.shape[0],
        embed_dim=d, hidden_dim=int(get("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(kv_heads), head_dim=head_dim, layer_kinds=kinds, query_pre_attn_scalar=float(qpas),
        rope_base_global=base, rope_base_local=base_l, rope_scale_global=scale, sliding_window=window,
        attn_logit_softcap=None if caps[0] is None else _f32(caps[0]),
        final_logit_softcap=None if caps[1] is None else _f32(caps[1]),
        use_qk_norm=family == "gemma3", use_post_attn_norm=later, use_post_ffw_norm=later,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=int(get("context_length", 8192)))
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _f32(value) -> float:
  """A float32 metadata value as the decimal it was written from (1e-6, not 9.99999997e-07)."""
  return float(str(np.float32(value)))


def _gguf_layer_kinds(pattern, layers: int, default_period: int) -> tuple[str, ...]:
  """Newer llama.cpp files may carry the pattern: a period, or one bool per layer (True = sliding)."""
  if isinstance(pattern, np.ndarray) and pattern.size == layers:
    return tuple("local" if bool(p) else "global" for p in pattern)
  period = int(pattern) if isinstance(pattern, int | np.integer) and pattern > 0 else default_period
  return tuple("global" if (i + 1) % period == 0 else "local" for i in range(layers))


# --- tensors ---------------------------------------------------------------------------------------

def _hf_name_map(family: str, layers: int) -> dict[str, str]:
  """GGUF tensor name -> HF name (the inverse of llama.cpp's convert_hf_to_gguf for Gemma)."""
  names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
  per_layer = {
      "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
      "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj",
  }
  if family == "gemma1":
    per_layer["ffn_norm"] = "post_attention_layernorm"
  else:
    per_layer.update(post_attention_norm="post_attention_layernorm", ffn_norm="pre_feedforward_layernorm",
                     post_ffw_norm="post_feedforward_layernorm")
  for i in range(layers):
    for gguf_name, hf_name in per_layer.items():
      names[f"blk.{i}.{gguf_name}.weight"] = f"model.layers.{i}.{hf_name}.weight"
  return names


def _dequantize(file: GGUFFile, raw: np.ndarray, info: TensorInfo) -> np.ndarray:
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
  from gguf.quants import dequantize
  qtype = GGMLQuantizationType(info.ggml_type)
  block, type_size = GGML_QUANT_SIZES[qtype]
  row_bytes = info.shape[-1] // block * type_size
  data = raw[info.offset:info.offset + info.nbytes].reshape(*info.shape[:-1], row_bytes)
  try:
    out = np.asarray(dequantize(data, qtype), np.float32)
  except NotImplementedError:
    raise WeightsError(f"GGUF {file.path.name}: tensor {info.name} has type {qtype.name}, "
                       "which gguf cannot dequantize") from None
  if out.shape != info.shape:
    raise WeightsError(f"GGUF {file.path.name}: tensor {info.name} dequantized to {out.shape}, "
                       f"expected {info.shape}")
  return out


def hf_tensors_from_gguf(file: GGUFFile, config: GemmaConfig) -> dict[str, np.ndarray]:
  """Dequantized float32 tensors under HF names, norms back in Gemma's (1 + w) convention."""
  if "output.weight" in file.tensors:
    raise ConfigError(f"GGUF {file.path.name} has an untied output.weight; the model ties its embeddings")
  name_map = _hf_name_map(config.family, config.num_layers)
  unknown = sorted(set(file.tensors) - set(name_map))
  if unknown:
    raise WeightsError(f"GGUF {file.path.name} has {len(unknown)} tensor(s) the model does not use, "
                       f"first: {unknown[0]}")
  raw = np.memmap(file.path, dtype=np.uint8, mode="r")
  out = {}
  for gguf_name, info in file.tensors.items():
    array = _dequantize(file, raw, info)
    if gguf_name.endswith("norm.weight"):  # llama.cpp stored 1 + w
      array = array - 1.0
    out[name_map[gguf_name]] = array
  return out


# --- cache -----------------------------------------------------------------------------------------

def default_cache_dir(gguf_path: Path) -> Path:
  """$PASTA_JAX_CACHE, else a folder beside the GGUF if writable, else ~/.cache/pasta_jax."""
  if os.environ.get("PASTA_JAX_CACHE"):
    return Path(os.environ["PASTA_JAX_CACHE"])
  beside = gguf_path.parent / ".pasta_jax_cache"
  if os.access(gguf_path.parent, os.W_OK):
    return beside
  return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pasta_jax"


def cache_key(gguf_path: Path) -> str:
  """What names a GGUF's cached conversions: its name, size and modification time."""
  stat = gguf_path.stat()
  return f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def cache_path(gguf_path: Path, cache_dir: Path) -> Path:
  return cache_dir / f"{cache_key(gguf_path)}-v{CACHE_FORMAT}{CACHE_SUFFIX}"


def _read_cache(path: Path, config: GemmaConfig, dtype: np.dtype) -> weights.Params | None:
  """The cached tree, if it was written for this very config (parsing rules may have changed since): mapped from
  the file, not read into new memory (`weight_file`)."""
  try:
    flat, metadata = weight_file.load(path)
    if config_from_dict(metadata["config"]) != config:
      log.info("GGUF cache %s was made for another config; rebuilding", path)
      return None
  except Exception as e:  # a torn or stale cache file is rebuilt, never fatal
    log.warning("ignoring unreadable GGUF cache %s: %s", path, e)
    return None
  return {"params": weight_file.unflatten({k: v if v.dtype == dtype else v.astype(dtype) for k, v in flat.items()})}


def _write_cache(path: Path, stem: str, config: GemmaConfig, params: weights.Params) -> None:
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*path.parent.glob(f"{glob.escape(stem)}-*{CACHE_SUFFIX}"),
                  *path.parent.glob(f"{glob.escape(stem)}-*.safetensors")]:  # the earlier format's files
      if stale.name.rsplit("-", 3)[0] == stem and stale != path:
        stale.unlink(missing_ok=True)  # an older version of the same file: don't keep GBs around
    flat = {k: np.asarray(v).astype(np.float32, copy=False) for k, v in weight_file.flatten(params["params"]).items()}
    weight_file.save(path, flat, {"config": config_to_dict(config)})
  except Exception as e:  # full or read-only disk: the cache is an optimisation only
    log.warning("could not write GGUF cache %s: %s", path, e)


# --- entry point -----------------------------------------------------------------------------------

def load_gguf(path: str | os.PathLike, dtype: Any = jnp.float32,
              cache_dir: str | os.PathLike | None | bool = None) -> tuple[GemmaConfig, weights.Params]:
  """(config, params) of a Gemma GGUF, dequantized to float32 then cast to `dtype`.

  cache_dir: where to keep the dequantized tree (None: `default_cache_dir`; False: no cache).
  """
  path = Path(path)
  target = weights.resolve_dtype(dtype)
  if not path.is_file():
    raise WeightsError(f"no such GGUF file: {path}")
  file = read_gguf(path)  # under a second even for 262k tokens; validates the file every time
  config = config_from_gguf(file)
  cache = None
  if cache_dir is not False:
    cache = cache_path(path, Path(cache_dir) if cache_dir else default_cache_dir(path))
    if cache.exists():
      hit = _read_cache(cache, config, target)
      if hit is not None:
        return config, hit
  tensors = hf_tensors_from_gguf(file, config)
  params32 = weights.params_from_hf(tensors, config, np.float32)
  del tensors
  if cache is not None:
    _write_cache(cache, path.stem, config, params32)
  if target == np.float32:
    return config, params32
  cast = weight_file.unflatten({k: jnp.asarray(v, target) for k, v in weight_file.flatten(params32["params"]).items()})
  return config, {"params": cast}

