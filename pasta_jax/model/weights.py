"""Hugging Face safetensors <-> our Flax parameter tree, and HF `config.json` <-> GemmaConfig.

HF stores each projection as a torch Linear weight [out, in]; we store einsum-ready tensors
(see the tree in `gemma.py`): q [D, H, hd], k/v [D, K, hd], o [H, hd, D], gate/up [D, F],
down [F, D]. Norm scales need no change: both sides multiply by (1 + scale).

Gemma 1's `post_attention_layernorm` is the norm *before* the MLP (our `pre_ffw_norm`); from
Gemma 2 on, the same HF name is a post-attention norm and `pre_feedforward_layernorm` is ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import ConfigError, WeightsError
from pasta_jax.model.config import GemmaConfig

Params = dict[str, Any]  # {'params': {...}} as Flax's apply takes it
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_FAMILY_OF_MODEL_TYPE = {"gemma": "gemma1", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
_MODEL_TYPE_OF_FAMILY = {"gemma1": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_LAYER_KIND = {"full_attention": "global", "sliding_attention": "local"}
_HF_LAYER_TYPE = {v: k for k, v in _LAYER_KIND.items()}


# --- dtype ---------------------------------------------------------------------------------------

def resolve_dtype(dtype: Any) -> np.dtype:
  """float32 / bfloat16 / float16 given as a jnp dtype, numpy dtype or name."""
  try:
    resolved = np.dtype(jnp.dtype(dtype))
  except TypeError:
    raise ConfigError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16") from None
  if resolved not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
    raise ConfigError(f"unsupported parameter dtype {resolved}; use float32, bfloat16 or float16")
  return resolved


# --- config ----------------------------------------------------------------------------------------

def _rope_entry(rope: Mapping[str, Any] | None, what: str) -> tuple[float | None, float]:
  """(theta or None, linear scale) of one HF rope-parameter dict; other rope types are refused."""
  if not rope:
    return None, 1.0
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  theta = rope.get("rope_theta")
  if rope_type == "default":
    return theta, 1.0
  if rope_type == "linear":
    return theta, float(rope["factor"])
  raise ConfigError(f"unsupported rope_type {rope_type!r} for {what} (supported: default, linear)")


def _rope_bases(cfg: Mapping[str, Any], family: str) -> tuple[float, float, float]:
  """(global base, local base, global linear scale) from either the transformers 5 layout
  (`rope_parameters`, per layer type for Gemma 3) or the older rope_theta / rope_local_base_freq /
  rope_scaling keys."""
  params = cfg.get("rope_parameters") or {}
  nested = "full_attention" in params or "sliding_attention" in params
  if family == "gemma3":
    full = params.get("full_attention") if nested else (params or None)
    theta_g, scale = _rope_entry(full, "full attention")
    local = params.get("sliding_attention") if nested else None
    theta_l, local_scale = _rope_entry(local, "sliding attention")
    if local_scale != 1.0:
      raise ConfigError("rope scaling on sliding-attention layers is not supported")
    if scale == 1.0 and cfg.get("rope_scaling"):
      _, scale = _rope_entry(cfg["rope_scaling"], "full attention")
    base_g = theta_g or cfg.get("rope_theta") or 1_000_000.0
    base_l = theta_l or cfg.get("rope_local_base_freq") or 10_000.0
    return float(base_g), float(base_l), scale
  theta, scale = _rope_entry(params or cfg.get("rope_scaling"), family)
  if scale != 1.0:
    raise ConfigError(f"rope scaling is not supported for {family} (our {family} applies RoPE unscaled)")
  base = float(theta or cfg.get("rope_theta") or 10_000.0)
  return base, base, 1.0


def _layer_kinds(cfg: Mapping[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
  types = cfg.get("layer_types")
  if family == "gemma1":
    return ("global",) * num_layers
  if types is None:  # older configs: a period (Gemma 3's sliding_window_pattern, Gemma 2 alternates)
    period = int(cfg.get("sliding_window_pattern", 6 if family == "gemma3" else 2))
    return tuple("global" if (i + 1) % period == 0 else "local" for i in range(num_layers))
  unknown = sorted(set(types) - set(_LAYER_KIND))
  if unknown:
    raise ConfigError(f"unknown layer_types {unknown} (supported: {sorted(_LAYER_KIND)})")
  return tuple(_LAYER_KIND[t] for t in types)


def config_from_hf(config: Mapping[str, Any], name: str = "") -> GemmaConfig:
  """GemmaConfig from an HF `config.json` dict (gemma, gemma2, gemma3_text, or gemma3 multimodal)."""
  model_type = config.get("model_type")
  family = _FAMILY_OF_MODEL_TYPE.get(model_type)
  if family is None:
    raise ConfigError(f"unknown architecture model_type={model_type!r}; supported: "
                      f"{', '.join(_FAMILY_OF_MODEL_TYPE)}")
  cfg = config
  if model_type == "gemma3":  # multimodal wrapper: the text model's config is nested
    cfg = dict(config.get("text_config") or {})
  name = name or str(config.get("_name_or_path") or "")
  if cfg.get("use_bidirectional_attention"):
    raise ConfigError(f"{model_type}: use_bidirectional_attention=True is not supported (causal LMs only)")
  if cfg.get("attention_bias"):
    raise ConfigError(f"{model_type}: attention_bias=True is not supported (Gemma has no biases)")
  if cfg.get("tie_word_embeddings", True) is False:
    raise ConfigError(f"{model_type}: tie_word_embeddings=False is not supported (the model ties them)")
  act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
  # HF maps a Gemma 1 "gelu" (the original release's value) to the tanh approximation too.
  if act not in ("gelu_pytorch_tanh", "gelu_new") and not (family == "gemma1" and act == "gelu"):
    raise ConfigError(f"{model_type}: unsupported activation {act!r} (the model uses tanh-approximate GELU)")

  missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
             if cfg.get(k) is None]
  if missing:
    raise ConfigError(f"{model_type} config lacks required key(s) {missing}")
  num_layers = int(cfg["num_hidden_layers"])
  num_heads = int(cfg["num_attention_heads"])
  head_dim = int(cfg.get("head_dim") or 256)
  base_g, base_l, scale = _rope_bases(cfg, family)
  kinds = _layer_kinds(cfg, family, num_layers)
  if family == "gemma1":  # HF Gemma 1 scales by head_dim**-0.5 and has no caps or windows
    qpas, window, attn_cap, final_cap = head_dim, None, None, None
  else:
    qpas = cfg.get("query_pre_attn_scalar", 256)
    window = cfg.get("sliding_window", 4096)
    default_caps = (50.0, 30.0) if family == "gemma2" else (None, None)
    attn_cap = cfg.get("attn_logit_softcapping", default_caps[0])
    final_cap = cfg.get("final_logit_softcapping", default_caps[1])
  later = family != "gemma1"
  try:
    return GemmaConfig(
        family=family, name=name,
        vocab_size=int(cfg.get("vocab_size", 262_208 if family == "gemma3" else 256_000)),
        embed_dim=int(cfg["hidden_size"]), hidden_dim=int(cfg["intermediate_size"]), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads), head_dim=head_dim,
        layer_kinds=kinds, query_pre_attn_scalar=float(qpas), rope_base_global=base_g, rope_base_local=base_l,
        rope_scale_global=scale, sliding_window=None if window is None else int(window),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
        use_qk_norm=family == "gemma3", use_post_attn_norm=later, use_post_ffw_norm=later,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 8192)))
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _int_if_whole(x: float) -> int | float:
  """HF's strict config classes type query_pre_attn_scalar as int."""
  return int(x) if float(x).is_integer() else x


def config_to_hf(config: GemmaConfig) -> dict[str, Any]:
  """The HF `config.json` (transformers 5 layout) of a GemmaConfig; `config_from_hf` inverts it."""
  out: dict[str, Any] = {
      "model_type": _MODEL_TYPE_OF_FAMILY[config.family], "vocab_size": config.vocab_size,
      "hidden_size": config.embed_dim, "intermediate_size": config.hidden_dim,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position,
      "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1,
      "pad_token_id": 0, "_name_or_path": config.name,
  }
  act_key = "hidden_act" if config.family == "gemma1" else "hidden_activation"
  out[act_key] = "gelu_pytorch_tanh"
  if config.family == "gemma1":
    if config.query_pre_attn_scalar != config.head_dim or config.sliding_window or config.attn_logit_softcap:
      raise ConfigError(f"{config.name or 'gemma1'}: HF Gemma 1 cannot express "
                        "query_pre_attn_scalar != head_dim, windows or soft-caps")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_base_global}
    return out
  out.update(
      layer_types=[_HF_LAYER_TYPE[k] for k in config.layer_kinds], sliding_window=config.sliding_window,
      query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
      attn_logit_softcapping=config.attn_logit_softcap,
      final_logit_softcapping=config.final_logit_softcap)
  if config.family == "gemma2":
    if config.rope_base_local != config.rope_base_global or config.rope_scale_global != 1.0:
      raise ConfigError(f"{config.name or 'gemma2'}: HF Gemma 2 has one unscaled RoPE base")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_base_global}
  else:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base_global}
    if config.rope_scale_global != 1.0:
      full = {**full, "rope_type": "linear", "factor": config.rope_scale_global}
    out["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_base_local},
    }
  return out


# --- tensor name and layout mapping ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor: its name, HF shape, where it goes in our tree and how to reshape it."""

  hf_name: str
  hf_shape: tuple[int, ...]
  path: tuple[str, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x: np.ndarray) -> np.ndarray:
  return x


def _entries(config: GemmaConfig, prefix: str = "model.") -> Iterator[_Entry]:
  """Every tensor of the text model, in checkpoint order."""
  d, f, h, k, hd = config.embed_dim, config.hidden_dim, config.num_heads, config.num_kv_heads, config.head_dim

  def in_proj(heads: int):  # Linear [heads*hd, D] <-> [D, heads, hd]
    return (lambda w: w.T.reshape(d, heads, hd)), (lambda w: w.reshape(d, heads * hd).T)

  out_proj = (lambda w: w.T.reshape(h, hd, d)), (lambda w: w.reshape(h * hd, d).T)  # [D, H*hd] <-> [H, hd, D]
  transpose = (lambda w: w.T), (lambda w: w.T)
  plain = (_identity, _identity)

  yield _Entry(f"{prefix}embed_tokens.weight", (config.vocab_size, d), ("embedder",), *plain)
  ffw_in = "post_attention_layernorm" if config.family == "gemma1" else "pre_feedforward_layernorm"
  for i in range(config.num_layers):
    hf, ours = f"{prefix}layers.{i}.", f"layer_{i}"
    attn = f"{hf}self_attn."
    yield _Entry(f"{attn}q_proj.weight", (h * hd, d), (ours, "attn", "q"), *in_proj(h))
    yield _Entry(f"{attn}k_proj.weight", (k * hd, d), (ours, "attn", "k"), *in_proj(k))
    yield _Entry(f"{attn}v_proj.weight", (k * hd, d), (ours, "attn", "v"), *in_proj(k))
    yield _Entry(f"{attn}o_proj.weight", (d, h * hd), (ours, "attn", "o"), *out_proj)
    if config.use_qk_norm:
      yield _Entry(f"{attn}q_norm.weight", (hd,), (ours, "attn", "q_norm", "scale"), *plain)
      yield _Entry(f"{attn}k_norm.weight", (hd,), (ours, "attn", "k_norm", "scale"), *plain)
    yield _Entry(f"{hf}input_layernorm.weight", (d,), (ours, "pre_attn_norm", "scale"), *plain)
    if config.use_post_attn_norm:
      yield _Entry(f"{hf}post_attention_layernorm.weight", (d,), (ours, "post_attn_norm", "scale"), *plain)
    yield _Entry(f"{hf}{ffw_in}.weight", (d,), (ours, "pre_ffw_norm", "scale"), *plain)
    if config.use_post_ffw_norm:
      yield _Entry(f"{hf}post_feedforward_layernorm.weight", (d,), (ours, "post_ffw_norm", "scale"), *plain)
    yield _Entry(f"{hf}mlp.gate_proj.weight", (f, d), (ours, "mlp", "gate"), *transpose)
    yield _Entry(f"{hf}mlp.up_proj.weight", (f, d), (ours, "mlp", "up"), *transpose)
    yield _Entry(f"{hf}mlp.down_proj.weight", (d, f), (ours, "mlp", "down"), *transpose)
  yield _Entry(f"{prefix}norm.weight", (d,), ("final_norm", "scale"), *plain)


def hf_tensor_shapes(config: GemmaConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
  """HF name -> HF shape of every tensor the model needs, in checkpoint order."""
  return {e.hf_name: e.hf_shape for e in _entries(config, prefix)}


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def find_prefix(names) -> str:
  """The text model's prefix: 'model.' (CausalLM), 'model.language_model.' (Gemma 3 multimodal), ..."""
  names = list(names)
  embeds = sorted(n[: -len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight")
                  and "vision" not in n)
  if not embeds:
    raise WeightsError(f"no embed_tokens.weight among {len(names)} tensors (not a Gemma checkpoint?)")
  if len(embeds) > 1:
    tables = [p + "embed_tokens.weight" for p in embeds]
    raise WeightsError(f"ambiguous checkpoint: several embedding tables {tables}")
  return embeds[0]


def params_from_hf(get_tensor: Callable[[str], np.ndarray] | Mapping[str, np.ndarray], config: GemmaConfig,
                   dtype: Any = jnp.float32, prefix: str = "model.", names=None) -> Params:
  """Our {'params': ...} tree from HF tensors (a mapping or a name -> array callable).

  names: all tensor names the source holds, to report unexpected text-model tensors (e.g. biases)
  instead of silently ignoring them.
  """
  target = resolve_dtype(dtype)
  lookup = get_tensor.__getitem__ if isinstance(get_tensor, Mapping) else get_tensor
  if names is None and isinstance(get_tensor, Mapping):
    names = list(get_tensor.keys())
  expected = list(_entries(config, prefix))
  if names is not None:
    names = set(names)
    missing = [e.hf_name for e in expected if e.hf_name not in names]
    if missing:
      raise WeightsError(f"checkpoint lacks {len(missing)} tensor(s) of {config.name or config.family}, "
                         f"first: {missing[0]}")
    known = {e.hf_name for e in expected}
    # rotary inv_freq buffers (old checkpoints) and the tied lm_head carry no parameters of ours
    extra = sorted(n for n in names if n.startswith(prefix) and n not in known and "rotary_emb" not in n)
    if extra:
      raise WeightsError(f"checkpoint has {len(extra)} tensor(s) the model does not use, first: {extra[0]}")
  tree: dict[str, Any] = {}
  for entry in expected:
    try:
      array = np.asarray(lookup(entry.hf_name))
    except KeyError:
      raise WeightsError(f"checkpoint lacks tensor {entry.hf_name}") from None
    if tuple(array.shape) != entry.hf_shape:
      raise ConfigError(f"shape mismatch for tensor {entry.hf_name}: expected {list(entry.hf_shape)} "
                        f"(config {config.name or config.family}), got {list(array.shape)}")
    # reshape in float32 on the host, then one cast: bf16 checkpoints load exactly either way
    ours = np.ascontiguousarray(entry.to_ours(array)).astype(target, copy=False)
    _set(tree, entry.path, jnp.asarray(ours))
  return {"params": tree}


def params_to_hf(params: Params, config: GemmaConfig, prefix: str = "model.") -> dict[str, np.ndarray]:
  """HF state dict (numpy, the params' dtype) of our tree; the inverse of `params_from_hf`."""
  tree = params.get("params", params)
  out = {}
  for entry in _entries(config, prefix):
    try:
      value = np.asarray(jax.device_get(_get(tree, entry.path)))
    except KeyError:
      raise WeightsError(f"params lack {'/'.join(entry.path)} for {entry.hf_name}") from None
    out[entry.hf_name] = np.ascontiguousarray(entry.to_hf(value))
  return out


# --- safetensors folders ---------------------------------------------------------------------------

class SafetensorsFolder:
  """Lazy view of a single-file or sharded safetensors checkpoint: name -> numpy array."""

  def __init__(self, folder: str | os.PathLike):
    self.folder = Path(folder)
    index = self.folder / INDEX_FILE
    single = self.folder / SINGLE_FILE
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested too deeply
        raise WeightsError(f"corrupt shard index {index}: {e}") from None
      shards = sorted(set(weight_map.values()))
      missing = [s for s in shards if not (self.folder / s).is_file()]
      if missing:
        raise WeightsError(f"shard {missing[0]} named in {index} is missing"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
      self.weight_map: dict[str, str] = dict(weight_map)
    elif single.exists():
      self.weight_map = {name: SINGLE_FILE for name in self._keys(single)}
    else:
      raise WeightsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")
    self._open: dict[str, Any] = {}

  @staticmethod
  def _keys(path: Path) -> list[str]:
    from safetensors import safe_open
    try:
      with safe_open(str(path), framework="np") as f:
        return list(f.keys())
    except Exception as e:  # the library raises its own error types for bad headers
      raise WeightsError(f"unreadable safetensors file {path}: {e}") from None

  def names(self) -> list[str]:
    return list(self.weight_map)

  def __call__(self, name: str) -> np.ndarray:
    from safetensors import safe_open
    shard = self.weight_map[name]  # KeyError -> the caller reports the missing tensor
    handle = self._open.get(shard)
    if handle is None:
      try:
        handle = self._open[shard] = safe_open(str(self.folder / shard), framework="np")
      except Exception as e:
        raise WeightsError(f"unreadable safetensors shard {self.folder / shard}: {e}") from None
    try:
      return handle.get_tensor(name)
    except Exception as e:
      raise WeightsError(f"tensor {name} (listed in shard {shard}) cannot be read: {e}") from None


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
  path = Path(folder) / "config.json"
  if not path.is_file():
    raise WeightsError(f"no config.json in {folder}")
  try:
    return json.loads(path.read_text())
  except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
    raise ConfigError(f"corrupt {path}: {e}") from None


def load_hf(folder: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[GemmaConfig, Params]:
  """(config, params) of an HF Gemma folder: config.json plus model.safetensors or a sharded index."""
  folder = Path(folder)
  if not folder.is_dir():
    raise WeightsError(f"no such model folder: {folder}")
  config = config_from_hf(read_hf_config(folder), name=folder.name)
  source = SafetensorsFolder(folder)
  names = source.names()
  params = params_from_hf(source, config, dtype, prefix=find_prefix(names), names=names)
  return config, params


def save_hf(folder: str | os.PathLike, params: Params, config: GemmaConfig,
            max_shard_bytes: int | None = None) -> Path:
  """Write an HF folder (config.json + safetensors, sharded with an index past max_shard_bytes)."""
  from safetensors.numpy import save_file
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
  state = params_to_hf(params, config)
  total = sum(a.nbytes for a in state.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    save_file(state, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    return folder
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in state.items():  # greedy, in checkpoint order, like HF's own sharding
    if shards[-1] and size + array.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  width = max(5, int(math.log10(len(shards))) + 1)
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
    save_file(shard, str(folder / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
  return folder
