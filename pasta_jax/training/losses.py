"""Log-likelihoods and losses over PASTA training layouts.

A batch is a stacked `Layout` ([B, L] arrays, horizon [B, L, U]). The model takes its thread metadata
(`Layout.thread_mask`) and the attention mask comes from the one visibility rule on device (built once by
XLA attention, or tile by tile by the attention kernel), so the full forward sees exactly what the
interpreter sees at decode time, and positions come from the layout (promise `tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from pasta_jax.lang.layout import Layout
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.output import ModelOutput

ApplyFn = Callable[..., ModelOutput]
EXCLUDED_LOGIT = -1e30  # an excluded token's logit in the KL: probability 0, every term finite


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


@dataclasses.dataclass(frozen=True)
class KlTags:
  """What the KL toward a sequential reference (the base, Baseline-SFT) leaves out of a PASTA answer.

  The reference reads the answer in text order; PASTA's main leaves that order at a promise (its topic is no
  text, and after its length token main writes what follows the block it skips) and comes back at a sync. There
  the reference's next token is not main's, and a KL would teach main to write the block itself, that is, not to
  fork. So the KL counts the positions in text order only: main before its first promise and after each sync,
  and every block's content (a fork sees the text before its promise, as the reference would)."""

  excluded: tuple[int, ...] = ()  # every tag: no mass in either distribution, no position whose target is one
  opens: tuple[int, ...] = ()  # a promise's first token: its topic follows
  closes: tuple[int, ...] = ()  # a promise's last token (its length): main skips the block
  syncs: tuple[int, ...] = ()  # main sees the synced blocks: back in text order

  @classmethod
  def of(cls, vocab: TagVocab) -> KlTags:
    return cls(tuple(sorted(vocab.tag_ids)), (vocab.promise,), tuple(vocab.lengths), (vocab.sync,))


NO_TAGS = KlTags()  # an answer without tags: every position in text order


def sft_kl_loss_sum(apply_fn: ApplyFn, reference_apply_fn: ApplyFn, params, reference_params, batch: Layout,
                    kl_weight: float, tags: KlTags = NO_TAGS) -> tuple[jax.Array, jax.Array, dict]:
  """SFT plus kl_weight x KL(tuned || reference) per loss token, as the earlier paper's adapter runs.

  The reference is the frozen base (`reference_apply_fn` the adapter-free model on the same params) or
  another adapter over it (e.g. Baseline-SFT), under stop_gradient: only the adapter moves.
  tags: for a PASTA answer, the tags the reference never writes (both distributions are renormalized over the
  other tokens, and a position whose target is a tag carries no KL) and the positions out of text order
  (`KlTags`), so the term pulls the text toward the reference's without teaching the model not to fork.
  """
  mask = batch.thread_mask()
  logits = apply_fn(params, batch.tokens, batch.positions, mask).logits  # [B, L, V]
  reference_logits = reference_apply_fn(reference_params, batch.tokens, batch.positions, mask).logits
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, batch.targets[..., None], axis=-1)[..., 0]
  nll = -jnp.where(batch.loss_mask, picked, 0.0).sum()
  kl = _content_kl(logits, jax.lax.stop_gradient(reference_logits), tags.excluded)  # [B, L]
  kl_mask = batch.loss_mask & ~jnp.isin(batch.targets, jnp.asarray(tags.excluded, jnp.int32))
  kl_mask &= in_text_order(batch.tokens, batch.thread, tags)
  kl_sum = jnp.where(kl_mask, kl, 0.0).sum()
  count = batch.loss_mask.sum().astype(jnp.float32)
  kl_count = kl_mask.sum().astype(jnp.float32)
  return nll + kl_weight * kl_sum, count, {"kl": kl_sum / jnp.maximum(kl_count, 1.0)}


def in_text_order(tokens: jax.Array, thread: jax.Array, tags: KlTags) -> jax.Array:
  """[B, L] bool: whether a position's next token is the next of the answer's text (`KlTags`). Main's rows are in
  its writing order in the layout, so the last promise opened, closed and synced at or before a row are running
  maxima of their indices over main's rows."""
  main = thread == 0
  index = jnp.arange(tokens.shape[-1])

  def last(ids: tuple[int, ...]) -> jax.Array:  # [B, L] index of main's last token among `ids`, -1 if none
    hit = main & jnp.isin(tokens, jnp.asarray(ids, jnp.int32))
    return jax.lax.cummax(jnp.where(hit, index, -1), axis=tokens.ndim - 1)

  opened, closed, synced = last(tags.opens), last(tags.closes), last(tags.syncs)
  return ~main | ((opened <= closed) & (closed <= synced))


def _content_kl(logits: jax.Array, reference_logits: jax.Array, excluded_ids: Sequence[int]) -> jax.Array:
  """[B, L] KL(p || q) of the two [B, L, V] logits' distributions over the tokens not in excluded_ids."""
  if excluded_ids:  # a finite floor, not -inf: 0 * (-inf - -inf) would turn the gradient into NaN
    ids = jnp.asarray(excluded_ids, jnp.int32)
    logits = logits.at[..., ids].set(EXCLUDED_LOGIT)
    reference_logits = reference_logits.at[..., ids].set(EXCLUDED_LOGIT)
  logp = jax.nn.log_softmax(logits, axis=-1)
  logq = jax.nn.log_softmax(reference_logits, axis=-1)
  return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
