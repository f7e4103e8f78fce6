"""BoNBoN preference loss (the later paper's equation, after Gui et al. 2024).

  L = E[ -a log p(y+|x) + (1 - a) (log p(y+|x)/p(y-|x) - log pref(y+|x)/pref(y-|x) - 1/b)^2 ]

log p(y|x) is the sum over the answer's tokens under the PASTA layout and mask
(`losses.sequence_logprob`); the reference log-probs are computed once and stored with the pairs.

Default beta = 0.1: the IPO term pulls the policy-vs-reference log-ratio margin toward 1/beta = 10
nats. Sequence log-probs are sums over hundreds of tokens, so a margin of 10 nats is a few
hundredths of a nat per token: enough to separate best from worst without pushing y- to zero
probability (a small beta, e.g. 0.01, asks for 100 nats and lets the IPO term dominate the
alpha-weighted SFT term). It is a flag (`--beta`, TrainConfig.bonbon_beta).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pasta_jax.lang.layout import Layout
from pasta_jax.training.losses import ApplyFn, sequence_logprob


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairBatch:
  chosen: Layout  # [B, L]
  rejected: Layout  # [B, L]
  ref_chosen: jax.Array  # [B] float32 log pref(y+|x)
  ref_rejected: jax.Array  # [B] float32 log pref(y-|x)


def bonbon_terms(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, alpha: float, beta: float):
  """[B] per-pair losses and [B] margins (policy log-ratio minus reference log-ratio)."""
  margin = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
  return -alpha * policy_chosen + (1.0 - alpha) * jnp.square(margin - 1.0 / beta), margin


def bonbon_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, alpha: float, beta: float) -> jax.Array:
  """Mean BoNBoN loss over pairs (all inputs [B] sequence log-probs)."""
  losses, _ = bonbon_terms(policy_chosen, policy_rejected, ref_chosen, ref_rejected, alpha=alpha, beta=beta)
  return losses.mean()


def _concat(a: Layout, b: Layout) -> Layout:
  return jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=0), a, b)


def bonbon_objective(apply_fn: ApplyFn, params, batch: PairBatch, *, alpha: float, beta: float):
  """(mean loss, aux) with one forward over the 2B chosen + rejected answers."""
  logp = sequence_logprob(apply_fn, params, _concat(batch.chosen, batch.rejected))
  chosen, rejected = jnp.split(logp, 2)
  losses, margin = bonbon_terms(chosen, rejected, batch.ref_chosen, batch.ref_rejected, alpha=alpha, beta=beta)
  aux = {"margin": margin.mean(), "reward_accuracy": (margin > 0).mean(), "logp_chosen": chosen.mean()}
  return losses.mean(), aux
