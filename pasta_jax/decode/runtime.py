"""How the model runs, whatever the decoding method: its dtype, its devices, its attention and its output head."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pasta_jax.errors import PastaError
from pasta_jax.model import thread_attention


@dataclasses.dataclass(frozen=True)
class Runtime:
  """The settings of the model call that every method shares (a jit-static part of a run's identity).

  dtype: the weights' and activations' dtype.
  mesh: a (data, fsdp, tensor) `jax.sharding.Mesh` to decode on (decode/sharding.py); None: one device.
  attention: "xla", or "pallas" (a kernel reads the thread metadata; on a CPU it runs in interpret mode).
  head_dtype: the output head in a narrower float dtype, float32 accumulation (`api.check_head_dtype`).
  certify_head: greedy choices certified against the float32 head at the narrow head's cost
  (decode/certified_head.py): the float32 model's tokens, faster on a CPU for 2-3 rows.
  """

  dtype: Any = "float32"
  mesh: Any = None
  attention: str = "xla"
  head_dtype: str | None = None
  certify_head: bool = False

  def __post_init__(self):
    try:
      object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
    except TypeError:
      raise PastaError(f"dtype must name a dtype such as 'float32' or 'bfloat16', got {self.dtype!r}") from None
    if self.attention not in thread_attention.CHOICES:
      raise PastaError(f"attention must be one of {', '.join(thread_attention.CHOICES)}, got {self.attention!r}")
