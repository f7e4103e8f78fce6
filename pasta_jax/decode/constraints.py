"""Constrained tag decoding: which tokens each kind of thread may sample, as [V] bool tables."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.lang.tags import TagVocab


def language_ids(vocab) -> jax.Array:
  """[n] the tag and end ids: the interpreter's language, never answer text."""
  return jnp.asarray(sorted(vocab.tag_ids | set(vocab.eos_ids)), jnp.int32)


@dataclasses.dataclass(frozen=True)
class AllowedTokens:
  """[V] bool masks, one per thread situation (docs/interpreter.md, Constraints)."""

  main: np.ndarray  # main outside a promise
  main_in_promise: np.ndarray  # main after PROMISE, before its LENGTH
  fork: np.ndarray
  apar: np.ndarray  # APAR mode, any thread: plain text, end ids and APAR_FORK
  apar_no_fork: np.ndarray  # APAR right after a fork or child token, or at the depth limit

  @classmethod
  def build(cls, vocab: TagVocab, vocab_size: int) -> AllowedTokens:
    def allow(*banned_groups) -> np.ndarray:
      mask = np.ones((vocab_size,), bool)
      for group in banned_groups:
        mask[[t for t in group if t < vocab_size]] = False
      return mask

    never = (vocab.async_open, vocab.apar_child, vocab.apar_fork, *vocab.scoped_tags)
    pasta_tags = (vocab.promise, vocab.async_open, vocab.async_close, vocab.sync, *vocab.lengths, *vocab.scoped_tags)
    return cls(
        main=allow(never, (vocab.async_close,), vocab.lengths),
        main_in_promise=allow(never, (vocab.promise, vocab.sync, vocab.async_close), vocab.eos_ids),
        fork=allow(never, (vocab.promise, vocab.sync), vocab.lengths),
        apar=allow(pasta_tags, (vocab.apar_child,)),
        apar_no_fork=allow(pasta_tags, (vocab.apar_child, vocab.apar_fork)),
    )

  def for_rows(self, is_main: jax.Array, in_promise: jax.Array) -> jax.Array:
    """Allowed masks for rows [...] -> [..., V]."""
    main = jnp.where(in_promise[..., None], jnp.asarray(self.main_in_promise), jnp.asarray(self.main))
    return jnp.where(is_main[..., None], main, jnp.asarray(self.fork))


  def for_apar_rows(self, no_fork: jax.Array) -> jax.Array:
    return jnp.where(no_fork[..., None], jnp.asarray(self.apar_no_fork), jnp.asarray(self.apar))


def constrain(logits: jax.Array, allowed: jax.Array) -> jax.Array:
  return jnp.where(allowed, logits, -jnp.inf)
