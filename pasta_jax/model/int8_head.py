"""The tied output head quantized to int8, for the certified head (decode/certified_head.py) only.

On XLA:CPU an int8 x int8 -> int32 matmul of 2-16 rows reads the 262k x 640 head (a quarter of float32's bytes)
faster than any float form (on a 2-core AMD EPYC: ~25 ms for 2-4 rows against 30-39 ms float32
weight-major; one row takes a slow path, ~280 ms, so one row never runs it). The weights carry one scale per
token; the hidden row is split into two int8 levels (x ~ s1 q1 + s2 q2, the second quantizing the first's
remainder), so its rounding is ~1/32000 of its largest entry and the bound the certificate needs stays as tight as
the bfloat16 copy's where one int8 level would leave 7% of rows uncertified. Every integer product is exact
(640 x 127 x 127 < 2^24, so the int32 sums also convert to float32 exactly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LEVELS = 2  # int8 levels of the hidden row
QMAX = 127.0


def quantize_head(embedding: jax.Array) -> tuple[jax.Array, jax.Array]:
  """embedding [V, D] float -> (q [D, V] int8, scale [V] float32): embedding[v] ~ scale[v] * q[:, v]. Stored
  [in, out] as the narrow copies are (`gemma.narrow_head`: the layout XLA:CPU's small-row matmul reads)."""
  w = embedding.astype(jnp.float32)
  scale = _scale(w)
  return jnp.round(w / scale[:, None]).astype(jnp.int8).T, scale


def dequantized(q: jax.Array, scale: jax.Array) -> jax.Array:
  """The [V, D] float32 head the int8 copy stands for (what the certificate's bound compares the head with)."""
  return q.astype(jnp.float32).T * scale[:, None]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [..., D] float32 -> (levels [LEVELS, ..., D] int8, scales [LEVELS, ..., 1], x_q [..., D] float32: the
  value the levels stand for, sum of scale * level)."""
  levels, scales, rest = [], [], x.astype(jnp.float32)
  x_q = jnp.zeros_like(rest)
  for _ in range(LEVELS):
    s = _scale(rest)[..., None]
    q = jnp.round(rest / s)
    levels.append(q.astype(jnp.int8))
    scales.append(s)
    x_q = x_q + s * q
    rest = x.astype(jnp.float32) - x_q
  return jnp.stack(levels), jnp.stack(scales), x_q


def int8_logits(x: jax.Array, q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [B, Q, D] times the int8 head (q [D, V], scale [V]) -> (logits of x_q [B, Q, V] float32, x_q [B, Q, D]):
  the levels go through one int8 matmul of LEVELS x Q rows."""
  levels, scales, x_q = quantize_rows(x)  # [L, B, Q, D], [L, B, Q, 1]
  rows = x.shape[1]
  sums = jnp.einsum("brd,dv->brv", jnp.concatenate(list(levels), axis=1), q, preferred_element_type=jnp.int32)
  # Kept apart from the scaling below: fused with it (or with a transpose of its rows), XLA:CPU leaves its fast
  # int8 kernel (2 rows: ~43 ms against ~26).
  sums = jax.lax.optimization_barrier(sums)  # [B, L * Q, V], exact and < 2^24: float32 holds it exactly
  total = sum(scales[i] * sums[:, i * rows:(i + 1) * rows].astype(jnp.float32) for i in range(LEVELS))
  return total * scale, x_q


def _scale(x: jax.Array) -> jax.Array:
  """Per row of x [..., D]: max |x| / QMAX, 1 for an all-zero row (its levels are then all zero)."""
  top = jnp.max(jnp.abs(x), axis=-1)
  return jnp.where(top > 0, top / QMAX, 1.0)
