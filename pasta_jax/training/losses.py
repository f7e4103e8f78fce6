"""Log-likelihoods and losses over PASTA training layouts.

A batch is a stacked `Layout` ([B, L] arrays, horizon [B, L, U]). The model takes its thread metadata
(`Layout.thread_mask`) and the attention mask comes from the one visibility rule on device (built once by
XLA attention, or tile by tile by the attention kernel), so the full forward sees exactly what the
interpreter sees at decode time, and positions come from the layout (promise `tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pasta_jax.lang.layout import Layout
from pasta_jax.model.output import ModelOutput

ApplyFn = Callable[..., ModelOutput]


def token_logprobs(apply_fn: ApplyFn, params, batch: Layout) -> jax.Array:
  """[B, L] float32 log p(target | visible context) of every position (0 where loss_mask is False)."""
  logits = apply_fn(params, batch.tokens, batch.positions, batch.thread_mask()).logits  # [B, L, V] f32
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


def sft_kl_loss_sum(apply_fn: ApplyFn, base_apply_fn: ApplyFn, params, batch: Layout,
                    kl_weight: float) -> tuple[jax.Array, jax.Array, dict]:
  """SFT plus kl_weight x KL(tuned || frozen base) per loss token, as the earlier paper's adapter runs.

  The base logits come from the same params with the adapter left out (`base_apply_fn` is the
  adapter-free model), under stop_gradient: only the adapter moves.
  """
  mask = batch.thread_mask()
  logits = apply_fn(params, batch.tokens, batch.positions, mask).logits  # [B, L, V]
  base_logits = base_apply_fn(params, batch.tokens, batch.positions, mask).logits
  logp = jax.nn.log_softmax(logits, axis=-1)
  base_logp = jax.lax.stop_gradient(jax.nn.log_softmax(base_logits, axis=-1))
  picked = jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]
  kl = jnp.sum(jnp.exp(logp) * (logp - base_logp), axis=-1)  # [B, L]
  nll = -jnp.where(batch.loss_mask, picked, 0.0).sum()
  kl_sum = jnp.where(batch.loss_mask, kl, 0.0).sum()
  count = batch.loss_mask.sum().astype(jnp.float32)
  return nll + kl_weight * kl_sum, count, {"kl": kl_sum / jnp.maximum(count, 1.0)}
