"""A tiny deterministic stand-in for Gemma with the same call signature, for interpreter tests.

next-token logits = table[token] + mean of embed[visible keys' tokens], plus a bias that makes
tag tokens likely, so sampled runs produce real tag programs (promises, syncs, EOS). Its
logits depend on the attention mask, so a wrong mask changes what it samples.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pasta_jax.model.gemma import KVPool, write_slots
from pasta_jax.model.kv_rows import FreshKV
from pasta_jax.model.output import ModelOutput
from pasta_jax.visibility import ThreadMask


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  vocab_size: int = 128
  width: int = 8  # K/V row width: one "head" of this size
  num_layers: int = 1
  num_kv_heads: int = 1
  head_dim: int = 8


def toy_params(cfg: ToyConfig, tag_bias: dict[int, float], seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  bias = np.zeros((cfg.vocab_size,), np.float32)
  for token, value in tag_bias.items():
    bias[token] = value
  return {
      "table": jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.vocab_size)).astype(np.float32)),
      "embed": jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.head_dim)).astype(np.float32)),
      "readout": jnp.asarray(rng.normal(size=(cfg.head_dim, cfg.vocab_size)).astype(np.float32)),
      "bias": jnp.asarray(bias),
  }


def toy_apply(params, tokens, positions, mask, pool: KVPool | None = None, slots=None, kv_positions=None, *,
              token_weights=None, logit_rows=None, defer_writes=False, return_hidden=False) -> ModelOutput:
  """Same contract as `Gemma.apply(params, ...)` for the arguments it takes: a `ModelOutput` with logits
  [B, R, V] and kv (the pool written, None without one), and with return_hidden head_input [B, R, hd], the rows'
  hidden states (input row + attended context: what Medusa heads read). With token_weights [B, Q, K], tokens
  are [B, Q, K] and each input row is their weighted mix. With defer_writes kv holds the new rows
  (`kv_rows.FreshKV`): it attends over its own written copy of the pool, which it drops."""
  del kv_positions
  if isinstance(mask, ThreadMask):
    mask = mask.dense()
  mix = (lambda x: x) if token_weights is None else (lambda x: jnp.einsum("bqk,bqk...->bq...", token_weights, x))
  rows = mix(params["embed"][tokens])  # [B, Q, hd]
  rows = rows + 0.01 * positions[..., None].astype(jnp.float32)
  if pool is None:
    keys = rows
  else:
    new_k = write_slots(pool.k, 0, rows[:, :, None, :], slots)
    pool = FreshKV(rows[None, :, :, None], rows[None, :, :, None], slots[None]) if defer_writes else \
        KVPool(new_k, new_k)
    keys = new_k[0, :, :, 0, :]  # [B, S, hd]
  weights = mask.astype(jnp.float32)
  context = jnp.einsum("bqs,bsd->bqd", weights, keys) / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
  logits = mix(params["table"][tokens]) + context @ params["readout"] + params["bias"]
  hidden = rows + context if return_hidden else None
  if logit_rows is not None:
    take = lambda a: None if a is None else jnp.take_along_axis(a, logit_rows[..., None], axis=1)
    logits, hidden = take(logits), take(hidden)
  return ModelOutput(logits=logits, head_input=hidden, kv=pool)
