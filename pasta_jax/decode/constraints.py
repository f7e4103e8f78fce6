"""Constrained tag decoding: which tokens each kind of thread may sample, as [V] bool tables."""

from __future__ import annotations

import dataclasses
import functools

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
  """[B] bool: `lang.tokens.repeats_earlier_topic` over the pool, as array ops over [B, S]: main's tokens are
  its slots (owner 0) in write order, and the block of main's j-th closed promise is the content (no tags or
  end ids) of thread j + 1 in write order."""
  batch, slots = slot_token.shape
  b = jnp.arange(batch)[:, None]
  index = jnp.broadcast_to(jnp.arange(slots), (batch, slots))
  # Every slot by (owner, write order): main's first, then each fork's; invalid slots last.
  owner_key = jnp.where(slot_valid, jnp.clip(slot_owner, 0, slots), slots + 1)
  perm = jnp.lexsort((slot_order, owner_key), axis=-1)
  tokens, owner = jnp.take_along_axis(slot_token, perm, 1), jnp.take_along_axis(owner_key, perm, 1)
  main = owner == 0
  # Main's promises: which topic each token belongs to, and whether it is inside one.
  is_promise = main & (tokens == vocab.promise)
  is_length = main & jnp.isin(tokens, jnp.asarray(vocab.lengths))
  last_promise = jax.lax.cummax(jnp.where(is_promise, index, -1), axis=1)
  last_length = jax.lax.cummax(jnp.where(is_length, index, -1), axis=1)
  shift = functools.partial(jnp.pad, pad_width=((0, 0), (1, 0)), constant_values=-1)
  promise_before = shift(last_promise[:, :-1])
  open_before = promise_before > shift(last_length[:, :-1])  # [B, S] a promise is open when this token comes
  in_topic = main & open_before & ~is_promise & ~is_length
  topic = jnp.maximum(jnp.cumsum(is_promise, axis=1) - 1, 0)  # [B, S] the latest promise's number
  place = jnp.clip(index - promise_before - 1, 0, slots - 1)  # the token's place in its topic
  closed = jnp.zeros((batch, slots), bool).at[b, topic].max(is_length & open_before)  # [B, S] per topic
  topic_keys = _hash_groups(tokens, in_topic, topic, place, slots)  # [B, S] per topic: length, two hashes
  current = jnp.take_along_axis(topic, jnp.full((batch, 1), slots - 1), 1)  # [B, 1] main's last topic
  now = [jnp.take_along_axis(k, current, 1) for k in topic_keys]  # [B, 1] each
  same_topic = closed
  for key, value in zip(topic_keys, now):
    same_topic = same_topic & (key == value)
  # Forks: each content token's place in its thread's block; the first len(topic) tokens of every block.
  content = (owner > 0) & (owner <= slots) & ~jnp.isin(tokens, language_ids(vocab))
  start = jnp.concatenate([jnp.ones((batch, 1), bool), owner[:, 1:] != owner[:, :-1]], axis=1)
  counted = jnp.cumsum(content, axis=1)
  before_block = jax.lax.cummax(jnp.where(start, counted - content, 0), axis=1)
  block_place = jnp.clip(counted - before_block - 1, 0, slots - 1)
  opening = content & (block_place < now[0])
  block_keys = _hash_groups(tokens, opening, jnp.minimum(owner, slots), block_place, slots + 1)  # per thread
  thread = jnp.clip(jnp.cumsum(closed, axis=1), 0, slots)  # [B, S] per topic: j + 1 for the j-th closed one
  begins_block = closed & (now[0] > 0)
  for key, value in zip(block_keys, now):
    begins_block = begins_block & (jnp.take_along_axis(key, thread, 1) == value)
  is_open = last_promise[:, -1] > last_length[:, -1]
  return is_open & jnp.any(same_topic | begins_block, axis=1)


def _hash_groups(tokens, member, group, place, groups: int) -> list[jax.Array]:
  """Per group: [B, groups] the count of member tokens and their two polynomial hashes (token + 1 at `place`)."""
  batch, slots = tokens.shape
  b = jnp.arange(batch)[:, None]
  keys = [jnp.zeros((batch, groups), jnp.int32).at[b, group].add(member.astype(jnp.int32))]
  for base in _TOPIC_HASH_BASES:
    term = (tokens.astype(jnp.uint32) + 1) * jnp.asarray(_hash_powers(base, slots))[place]
    keys.append(jnp.zeros((batch, groups), jnp.uint32).at[b, group].add(jnp.where(member, term, 0)))
  return keys
