"""PASTA learned asynchronous decoding of Gemma models in JAX/Flax.

The public names are imported lazily (PEP 562), so `import pasta_jax` stays fast and pulls in
neither JAX nor transformers until one of them is used.
"""

from __future__ import annotations

import importlib

from pasta_jax import xla_flags

xla_flags.apply()  # before any backend starts: the decode loop runs as one CUDA graph on a GPU

_EXPORTS = {
    "generate": "pasta_jax.decode.api",
    "Result": "pasta_jax.decode.api",
    "PastaResult": "pasta_jax.decode.api",
    "stream": "pasta_jax.decode.api",
    "SamplingConfig": "pasta_jax.decode.sampling",
    "load_model": "pasta_jax.model.load",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pasta_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
