"""The project's own checkpoints: Orbax-saved params plus the GemmaConfig, so a checkpoint knows its model.

Layout of a checkpoint directory:
  pasta_config.json   {"format", "config": GemmaConfig fields, "dtype", "tokenizer_source", "step", "extra"}
  params/             Orbax StandardCheckpointer tree ({'params': ...})
  tokenizer/          HF tokenizer files (optional; written when a Tokenizer is given)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import ConfigError, WeightsError
from pasta_jax.model.config import GemmaConfig, config_from_dict, config_to_dict

META_FILE = "pasta_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
FORMAT = 1


def is_checkpoint(path: str | os.PathLike) -> bool:
  from pasta_jax.paths import run_path
  return (run_path(path) / META_FILE).is_file()


def describe_difference(a: GemmaConfig, b: GemmaConfig) -> str:
  names = [f.name for f in dataclasses.fields(GemmaConfig) if f.name != "name"]
  diffs = [f"{n} {getattr(a, n)!r} vs {getattr(b, n)!r}" for n in names if getattr(a, n) != getattr(b, n)]
  return "; ".join(diffs) or "only the name differs"


def _label(config: GemmaConfig) -> str:
  return config.name or f"{config.family} ({config.num_layers} layers, d={config.embed_dim})"


def save_checkpoint(path: str | os.PathLike, params: dict, config: GemmaConfig, *, tokenizer=None,
                    tokenizer_source: str | None = None, step: int | None = None,
                    extra: dict[str, Any] | None = None, overwrite: bool = False, atomic: bool = True):
  """Save params ({'params': ...}) and config; with `tokenizer` (a Tokenizer) its files go alongside.

  tokenizer_source: where the tokenizer can be reloaded from (a .gguf or HF folder) when its files
  are not saved; a given `tokenizer` records its own source.
  atomic: write under a temporary name and rename into place (`runfiles.publish`: the old checkpoint is
  removed only after, a completion marker written last), so a kill never leaves a half-written checkpoint
  where a whole one was; False writes into `path` itself (a caller that publishes the folder).
  """
  import orbax.checkpoint as ocp

  from pasta_jax.model import runfiles
  from pasta_jax.paths import run_path, save_folder
  final = run_path(path)  # local (absolute, as Orbax requires) or remote (gs://)
  if final.exists() and any(final.iterdir()):
    if not overwrite:
      raise WeightsError(f"checkpoint directory {final} is not empty (pass overwrite=True to replace it)")
    if not is_checkpoint(final):  # overwrite replaces a checkpoint, never an arbitrary folder
      raise WeightsError(f"refusing to overwrite {final}: it is not empty and not a pasta checkpoint")
    if not atomic:
      final.rmtree()
  path = run_path(runfiles.partial_folder(final)) if atomic else final
  path.mkdir(parents=True, exist_ok=True)
  leaves = jax.tree.leaves(params)
  dtype = str(leaves[0].dtype) if leaves else "float32"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path / PARAMS_DIR, params, force=True)
  checkpointer.wait_until_finished()
  if tokenizer is not None:
    save_folder(path / TOKENIZER_DIR, tokenizer.save)
    tokenizer_source = tokenizer_source or tokenizer.source
  meta = {"format": FORMAT, "config": config_to_dict(config), "dtype": dtype,
          "tokenizer_source": tokenizer_source, "step": step, "extra": extra or {}}
  (path / META_FILE).write_text(json.dumps(meta, indent=2))
  if atomic:
    runfiles.publish(path, final)
  return final


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  path = Path(path)
  meta_file = path / META_FILE
  if not meta_file.is_file():
    raise WeightsError(f"not a pasta checkpoint: {path} has no {META_FILE}")
  try:
    meta = json.loads(meta_file.read_text())
  except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
    raise WeightsError(f"corrupt {meta_file}: {e}") from None
  if meta.get("format") != FORMAT:
    raise WeightsError(f"checkpoint {path} has format {meta.get('format')!r}, this version reads {FORMAT}")
  return meta


def load_checkpoint_config(path: str | os.PathLike) -> GemmaConfig:
  return config_from_dict(read_metadata(path)["config"])


def _expected_shapes(config: GemmaConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of the Flax tree for `config`, from an abstract init (no memory, no compute)."""
  from pasta_jax.model.gemma import Gemma
  tokens = jnp.zeros((1, 1), jnp.int32)
  mask = jnp.ones((1, 1, 1), bool)
  abstract = jax.eval_shape(lambda: Gemma(config).init(jax.random.PRNGKey(0), tokens, tokens, mask))
  return _shapes(abstract)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in flat}


def _restore_here(checkpointer, directory):
  """The saved arrays whole on this process's first device, whatever devices wrote them: Orbax alone refuses a
  checkpoint saved from another topology (a model trained on several hosts, each writing its shards)."""
  here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  saved = checkpointer.metadata(directory).item_metadata
  return checkpointer.restore(directory, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here),
                                                      saved))


def restore_checkpoint(path: str | os.PathLike, config: GemmaConfig | None = None,
                       dtype: Any = None) -> tuple[GemmaConfig, dict]:
  """(config, params) of a checkpoint. With `config`, it must be the checkpoint's own (ConfigError if not).

  dtype: cast the params (default: as saved).
  """
  import orbax.checkpoint as ocp
  path = Path(path).absolute()
  saved = config_from_dict(read_metadata(path)["config"])
  if config is not None and dataclasses.replace(config, name="") != dataclasses.replace(saved, name=""):
    raise ConfigError(f"checkpoint {path} holds model {_label(saved)!r}, not the requested "
                      f"{_label(config)!r}: {describe_difference(saved, config)}")
  if not (path / PARAMS_DIR).is_dir():
    raise WeightsError(f"checkpoint {path} has no {PARAMS_DIR}/ directory")
  try:
    params = _restore_here(ocp.StandardCheckpointer(), path / PARAMS_DIR)
  except Exception as e:  # Orbax/tensorstore raise assorted types for torn files
    first_line = (str(e).splitlines() or [""])[0]
    raise WeightsError(f"cannot restore {path / PARAMS_DIR}: {type(e).__name__}: {first_line}") from None
  expected = _expected_shapes(saved)
  got = _shapes(params)
  for key in sorted(set(expected) | set(got)):
    if expected.get(key) != got.get(key):
      raise ConfigError(f"checkpoint {path}: tensor {key} expected shape {expected.get(key)} for "
                        f"{_label(saved)!r}, got {got.get(key)}")
  if dtype is not None:
    from pasta_jax.model.weights import resolve_dtype
    target = resolve_dtype(dtype)
    params = jax.tree.map(lambda x: jnp.asarray(x, target), params)
  else:
    params = jax.tree.map(jnp.asarray, params)
  return saved, params


def checkpoint_tokenizer(path: str | os.PathLike):
  """The checkpoint's Tokenizer: its saved files, else its recorded source, else None."""
  from pasta_jax.model.tokenizer import Tokenizer, has_tokenizer_files
  path = Path(path)
  if has_tokenizer_files(path / TOKENIZER_DIR):
    return Tokenizer.from_hf(path / TOKENIZER_DIR)
  source = read_metadata(path).get("tokenizer_source")
  if source:
    if not Path(source).exists():
      raise WeightsError(f"checkpoint {path} names tokenizer source {source}, which does not exist")
    return Tokenizer.load(source)
  return None
