"""Token sampling: greedy, temperature, top-k, top-p, all on device with static settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"bad sampling settings {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def lane_key(base: jax.Array, request: jax.Array, step: jax.Array, lane: jax.Array) -> jax.Array:
  """The RNG key of one lane at one step: the same in the jitted loop and the reference."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, request), step), lane)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One token from logits [V] (already constrained with -inf). Returns int32 []."""
  if cfg.greedy:
    return jnp.argmax(logits).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / cfg.temperature
  neg = jnp.finfo(jnp.float32).min
  if cfg.top_k:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][-1]
    logits = jnp.where(logits < kth, neg, logits)
  if cfg.top_p < 1.0:
    order = jnp.argsort(-logits)
    probs = jax.nn.softmax(logits[order])
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep_sorted = (jnp.cumsum(probs) - probs) < cfg.top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    logits = jnp.where(keep, logits, neg)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def sample_rows(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Rows of logits [N, V] with keys [N] -> tokens [N]."""
  if cfg.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.vmap(lambda row, key: sample(row, key, cfg))(logits, keys)
