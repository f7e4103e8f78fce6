"""PASTA learned asynchronous decoding of Gemma models in JAX/Flax.

The public names are imported lazily (PEP 562), so `import pasta_jax` stays fast and pulls in
neither JAX nor transformers until one of them is used.
"""

from __future__ import annotations

import importlib

from pasta_jax import xla_flags

xla_flags.apply()  # before any backend starts: the decode loop runs as one CUDA graph on a GPU

_EXPORTS = {
    "generate": "pasta_jax.methods",
    "generate_ids": "pasta_jax.methods",
    "stream": "pasta_jax.methods",
    "stream_ids": "pasta_jax.methods",
    "Result": "pasta_jax.decode.result",
    "Runtime": "pasta_jax.decode.runtime",
    **{name: "pasta_jax.methods" for name in ("Apar", "Medusa", "Method", "Pasta", "PastaTrees", "Propd", "Scoped",
                                              "Sequential", "Sot", "Superposed")},
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
