"""Adapters: LoRA on chosen projections plus trainable embedding rows, and folding them into the weights.

An adapter is a small parameter tree beside the frozen base:
  layer_{i}/{attn,mlp}/{name}_lora_a   [*in, r]     (random, fan-in scaled)
  layer_{i}/{attn,mlp}/{name}_lora_b   [r, *out]    (zeros: a fresh adapter is the base model exactly)
  row_delta                            [n, D]       (zeros) added to the embedder rows `row_ids`
The projection becomes W + (alpha / r) A B. The embedder is tied to the output head, so a row delta
moves both the token's input embedding and its logit: the tag tokens (reserved `<unused*>` ids the
base never learned) and the chat-turn tokens get real embeddings without training the 262k x D table.

`Gemma(adapter=AdapterConfig(...))` runs the unfolded form (training: gradients reach A, B and the
rows only); `fold(base, adapter, config)` merges them once, after which decoding runs the plain model
at plain-model speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import ConfigError, WeightsError

ATTENTION = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")
TARGETS = ATTENTION + MLP
# Input axes of each projection in the training layout ([*in, *out]).
IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"
ROWS = "row_delta"
CONFIG_FILE = "adapter.json"
WEIGHTS_FILE = "adapter.safetensors"


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
  """rank: LoRA rank; alpha: its scale numerator (delta = alpha / rank * A B); targets: projections;
  row_ids: embedder rows that train (tag and chat-turn tokens)."""

  rank: int = 16
  alpha: float = 16.0
  targets: tuple[str, ...] = ATTENTION
  row_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.rank < 1:
      raise ConfigError(f"LoRA rank must be >= 1, got {self.rank}")
    unknown = sorted(set(self.targets) - set(TARGETS))
    if unknown:
      raise ConfigError(f"unknown LoRA targets {unknown}; choose from {', '.join(TARGETS)}")
    if len(set(self.row_ids)) != len(self.row_ids):
      raise ConfigError("adapter row_ids repeat a token id")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def to_dict(self) -> dict:
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "row_ids": list(self.row_ids)}

  @classmethod
  def from_dict(cls, fields: dict) -> AdapterConfig:
    return cls(int(fields["rank"]), float(fields["alpha"]), tuple(fields["targets"]),
               tuple(int(i) for i in fields.get("row_ids", ())))


def is_adapter_leaf(name: str) -> bool:
  return name.endswith((A_SUFFIX, B_SUFFIX)) or name == ROWS


def _items(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _items(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def init_adapter(base: dict, config: AdapterConfig, rng: jax.Array) -> dict:
  """A fresh adapter tree ({'params': ...}) for `base` (training layout): B and the rows are zero."""
  adapter: dict = {}
  targets = [(path, w) for path, w in _items(base) if path[-1] in config.targets]
  if not targets:
    raise ConfigError(f"no projection named {config.targets} in the base params")
  keys = jax.random.split(rng, len(targets))
  for key, (path, weight) in zip(keys, targets):
    n_in = IN_AXES[path[-1]]
    in_shape, out_shape = weight.shape[:n_in], weight.shape[n_in:]
    fan_in = int(np.prod(in_shape))
    a = jax.random.normal(key, in_shape + (config.rank,), jnp.float32) / np.sqrt(fan_in)
    _set(adapter, path[:-1] + (path[-1] + A_SUFFIX,), a)
    _set(adapter, path[:-1] + (path[-1] + B_SUFFIX,), jnp.zeros((config.rank,) + out_shape, jnp.float32))
  if config.row_ids:
    embed_dim = base["params"]["embedder"].shape[1]
    adapter.setdefault("params", {})[ROWS] = jnp.zeros((len(config.row_ids), embed_dim), jnp.float32)
  return adapter


def merge(base: dict, adapter: dict) -> dict:
  """One tree holding both (the unfolded model's params); the adapter's leaves are new names."""
  out = dict(base)
  for key, value in adapter.items():
    out[key] = merge(base.get(key, {}), value) if isinstance(value, dict) else value
  return out


def split(params: dict) -> tuple[dict, dict]:
  """(base, adapter) of a merged tree."""
  base: dict = {}
  adapter: dict = {}
  for path, leaf in _items(params):
    _set(adapter if is_adapter_leaf(path[-1]) else base, path, leaf)
  return base, adapter


def lora_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale * A B as a weight of the projection's shape [*in, *out]."""
  return scale * jnp.tensordot(a, b, axes=1)


def fold(base: dict, adapter: dict, config: AdapterConfig) -> dict:
  """The base params with the adapter merged in: W + scale A B, embedder rows + row_delta."""
  out = jax.tree.map(lambda x: x, base)  # a new tree; the caller's base is left as it was
  for path, a in _items(adapter):
    if not path[-1].endswith(A_SUFFIX):
      continue
    name = path[-1][: -len(A_SUFFIX)]
    parent = out
    for key in path[:-1]:
      parent = parent[key]
    b = _lookup(adapter, path[:-1] + (name + B_SUFFIX,))
    weight = parent[name]
    parent[name] = (weight.astype(jnp.float32) + lora_delta(a, b, config.scale)).astype(weight.dtype)
  rows = adapter.get("params", {}).get(ROWS)
  if rows is not None:
    embedder = out["params"]["embedder"]
    ids = jnp.asarray(config.row_ids, jnp.int32)
    out["params"]["embedder"] = embedder.at[ids].add(rows.astype(embedder.dtype))
  return out


def _lookup(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


# --- files: safetensors weights + a JSON config naming the base --------------------------------------
def save_adapter(folder: str | os.PathLike, adapter: dict, config: AdapterConfig, *, base: str,
                 extra: dict | None = None) -> Path:
  """Writes `adapter.safetensors` (flat '/'-joined names, float32) and `adapter.json`."""
  from safetensors.numpy import save_file
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  flat = {"/".join(path): np.asarray(leaf, np.float32) for path, leaf in _items(adapter)}
  save_file(flat, str(folder / WEIGHTS_FILE))
  meta = {"format": 1, "base": base, "adapter": config.to_dict(), **(extra or {})}
  (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
  return folder


def is_adapter_folder(path: str | os.PathLike) -> bool:
  return (Path(path) / CONFIG_FILE).is_file()


def load_adapter(folder: str | os.PathLike) -> tuple[dict, AdapterConfig, dict]:
  """(adapter tree, its config, the whole adapter.json) of a folder written by `save_adapter`."""
  from safetensors.numpy import load_file
  folder = Path(folder)
  try:
    meta = json.loads((folder / CONFIG_FILE).read_text())
    config = AdapterConfig.from_dict(meta["adapter"])
    flat = load_file(str(folder / WEIGHTS_FILE))
  except (OSError, KeyError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
    raise WeightsError(f"cannot read the adapter in {folder}: {e}") from None
  tree: dict = {}
  for name, value in flat.items():
    _set(tree, tuple(name.split("/")), jnp.asarray(value))
  return tree, config, meta


def adapter_bytes(adapter: dict) -> int:
  return sum(int(np.prod(leaf.shape)) * 4 for _, leaf in _items(adapter))


def check_matches(base: dict, adapter: dict, where: str) -> None:
  """Refuses an adapter whose projections do not fit the base (another model's adapter)."""
  for path, leaf in _items(adapter):
    name = path[-1]
    if name == ROWS:
      continue
    proj = name[: -len(A_SUFFIX)]
    try:
      weight = _lookup(base, path[:-1] + (proj,))
    except KeyError:
      raise WeightsError(f"{where}: adapter leaf {'/'.join(path)} has no base projection") from None
    n_in = IN_AXES[proj]
    want = weight.shape[:n_in] if name.endswith(A_SUFFIX) else weight.shape[n_in:]
    got = leaf.shape[:-1] if name.endswith(A_SUFFIX) else leaf.shape[1:]
    if tuple(want) != tuple(got):
      raise WeightsError(f"{where}: adapter leaf {'/'.join(path)} has shape {leaf.shape}, the base "
                         f"projection {weight.shape}: an adapter of another model")


def row_ids_for(vocab_tags: Sequence[int], extra: Sequence[int] = ()) -> tuple[int, ...]:
  """Sorted unique ids of the rows to train."""
  return tuple(sorted(set(int(i) for i in vocab_tags) | set(int(i) for i in extra)))
