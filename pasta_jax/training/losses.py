"""Log-likelihoods and losses over PASTA training layouts.

A batch is a stacked `Layout` ([B, L] arrays, horizon [B, L, U]). The attention mask is built on
device from the one visibility rule (`Layout.mask`), so the full forward sees exactly what the
interpreter sees at decode time, and positions come from the layout (promise `tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pasta_jax.lang.layout import Layout

ApplyFn = Callable[..., tuple[jax.Array, object]]


def token_logprobs(apply_fn: ApplyFn, params, batch: Layout) -> jax.Array:
  """[B, L] float32 log p(target | visible context) of every position (0 where loss_mask is False)."""
  logits, _ = apply_fn(params, batch.tokens, batch.positions, batch.mask())  # [B, L, V] f32
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0]
  return jnp.where(batch.loss_mask, picked - logz, 0.0)


def sequence_logprob(apply_fn: ApplyFn, params, batch: Layout) -> jax.Array:
  """[B] log p(answer | prompt) under the PASTA layout: the sum over loss tokens."""
  return token_logprobs(apply_fn, params, batch).sum(axis=-1)


def sft_loss_sum(apply_fn: ApplyFn, params, batch: Layout) -> tuple[jax.Array, jax.Array]:
  """(sum of token NLL, number of loss tokens) of a micro-batch; the step divides by the global count."""
  logp = token_logprobs(apply_fn, params, batch)
  return -logp.sum(), batch.loss_mask.sum().astype(jnp.float32)
