"""Constrained tag decoding: which tokens each kind of thread may sample, as [V] bool tables."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.sampling import first_max_index
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
  length: np.ndarray  # the LENGTH tokens, which close a topic (distinct_topics bans them; a cap allows only them)

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
        length=~allow(vocab.lengths),
    )

  def for_rows(self, is_main: jax.Array, in_promise: jax.Array) -> jax.Array:
    """Allowed masks for rows [...] -> [..., V]."""
    main = jnp.where(in_promise[..., None], jnp.asarray(self.main_in_promise), jnp.asarray(self.main))
    return jnp.where(is_main[..., None], main, jnp.asarray(self.fork))


  def for_apar_rows(self, no_fork: jax.Array) -> jax.Array:
    return jnp.where(no_fork[..., None], jnp.asarray(self.apar_no_fork), jnp.asarray(self.apar))


def constrain(logits: jax.Array, allowed: jax.Array) -> jax.Array:
  return jnp.where(allowed, logits, -jnp.inf)


def fork_open_ids(vocab: TagVocab) -> tuple[int, ...]:
  """The tokens that open a promise: PASTA-LANG's PROMISE, and the scoped form's `<promise/>` (each form's
  constraints ban the other's)."""
  return (vocab.promise, vocab.bare_promise)


def bias_fork_open(logits: jax.Array, bias: jax.Array, vocab: TagVocab) -> jax.Array:
  """logits [B, Q, V] with each request's fork bias (bias [B], `SamplingConfig.fork_bias`) added at the tokens that
  open a promise. The offset counts only where the rules let a promise open: their constraint then sets the token
  to -inf everywhere else (a PASTA fork, main inside a promise's topic), and -inf plus a finite bias stays -inf.
  One elementwise add that fuses with the constraint's select; a row at 0 keeps every logit (x + 0.0 == x)."""
  opens = jnp.isin(jnp.arange(logits.shape[-1]), jnp.asarray(fork_open_ids(vocab), jnp.int32))
  return logits + jnp.where(opens, bias[:, None, None], 0.0).astype(logits.dtype)


def open_topic_length(slot_token: jax.Array, slot_owner: jax.Array, slot_order: jax.Array, slot_valid: jax.Array,
                      vocab: TagVocab) -> jax.Array:
  """[B] int32: the tokens main has written after its last PROMISE (its open topic's length while it is inside a
  promise: the open topic of `lang.tokens.promise_topics`, which the reference counts), over [B, S] pool metadata."""
  mine = slot_valid & (slot_owner == 0)
  last_promise = jnp.max(jnp.where(mine & (slot_token == vocab.promise), slot_order, -1), axis=1)  # [B]
  return jnp.sum(mine & (slot_order > last_promise[:, None]), axis=1, dtype=jnp.int32)


def cap_topics(allowed: jax.Array, logits: jax.Array, at_cap: jax.Array, is_length: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """Rows [B, Q] `at_cap` (main, inside a topic that has its most tokens) may write only a LENGTH. Returns the
  allowed tokens [B, Q, V] and the rows [B, Q] whose most likely allowed token the cap refused (a topic the model
  would have continued: a cut, counted in `refusals`). The cap outranks `distinct_topics`: a topic at the cap
  closes even if it repeats an earlier one. Only a step with a row at its cap pays for the argmax the count reads.
  is_length: [V] the LENGTH tokens (`AllowedTokens.length`)."""

  def cut():
    top = first_max_index(jnp.where(allowed, logits, -jnp.inf))  # [B, Q] the choice the cap would have let stand
    return at_cap & ~is_length[top]

  refused = jax.lax.cond(jnp.any(at_cap), cut, lambda: jnp.zeros_like(at_cap))
  return jnp.where(at_cap[..., None], is_length, allowed), refused


# Two 32-bit polynomial hashes of a topic's tokens (with its length): topics that differ collide with
# probability ~2^-64 per pair.
_TOPIC_HASH_BASES = (1_000_003, 998_244_353)


@functools.lru_cache(maxsize=16)
def _hash_powers(base: int, n: int) -> np.ndarray:
  """[n] uint32: base^i mod 2^32."""
  out, acc = np.empty((n,), np.uint32), 1
  for i in range(n):
    out[i], acc = acc, (acc * base) % (1 << 32)
  return out


def repeated_topic(slot_token: jax.Array, slot_owner: jax.Array, slot_order: jax.Array, slot_valid: jax.Array,
                   vocab: TagVocab) -> jax.Array:
  """[B] bool: main's open promise repeats the topic of one of its closed promises: `lang.tokens.
  repeats_earlier_topic` over main's pool slots (owner 0) in write order, as array ops over [B, S]."""
  batch, slots = slot_token.shape
  mine = slot_valid & (slot_owner == 0)
  order = jnp.argsort(jnp.where(mine, slot_order, jnp.iinfo(jnp.int32).max), axis=1, stable=True)
  tokens = jnp.take_along_axis(slot_token, order, axis=1)  # [B, S] main's tokens first, in write order
  valid = jnp.take_along_axis(mine, order, axis=1)
  index = jnp.broadcast_to(jnp.arange(slots), (batch, slots))
  is_promise = valid & (tokens == vocab.promise)
  is_length = valid & jnp.isin(tokens, jnp.asarray(vocab.lengths))
  last_promise = jax.lax.cummax(jnp.where(is_promise, index, -1), axis=1)
  last_length = jax.lax.cummax(jnp.where(is_length, index, -1), axis=1)
  shift = functools.partial(jnp.pad, pad_width=((0, 0), (1, 0)), constant_values=-1)
  promise_before = shift(last_promise[:, :-1])
  open_before = promise_before > shift(last_length[:, :-1])  # [B, S] a promise is open when this token comes
  in_topic = valid & open_before & ~is_promise & ~is_length
  closes = is_length & open_before
  topic = jnp.maximum(jnp.cumsum(is_promise, axis=1) - 1, 0)  # [B, S] the latest promise's number
  place = jnp.clip(index - promise_before - 1, 0, slots - 1)  # the token's place in its topic
  b = jnp.arange(batch)[:, None]
  summed = [jnp.zeros((batch, slots), jnp.int32).at[b, topic].add(in_topic.astype(jnp.int32))]  # lengths
  for base in _TOPIC_HASH_BASES:
    term = (tokens.astype(jnp.uint32) + 1) * jnp.asarray(_hash_powers(base, slots))[place]
    summed.append(jnp.zeros((batch, slots), jnp.uint32).at[b, topic].add(jnp.where(in_topic, term, 0)))
  closed = jnp.zeros((batch, slots), bool).at[b, topic].max(closes)
  current = topic[:, -1:]
  same = closed
  for key in summed:
    same = same & (key == jnp.take_along_axis(key, current, axis=1))
  return (last_promise[:, -1] > last_length[:, -1]) & jnp.any(same, axis=1)
