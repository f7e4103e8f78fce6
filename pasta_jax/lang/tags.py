"""PASTA-LANG tags as single tokens.

Tags map onto reserved tokens the Gemma vocabularies already have (`<unused0>` ...), so
embeddings need no resizing and checkpoints stay compatible with stock ones:

  `<promise topic="`              PROMISE        then the topic as plain text tokens
  `" tokens="N"/>`                LENGTH[N]      one token per bucket N = 10, 20, ..., 500;
                                                 it closes the promise and triggers the fork
  `<async>` `</async>` `<sync/>`  ASYNC, ASYNC_END, SYNC
  APAR's fork and child tokens    APAR_FORK, APAR_CHILD

A fork is detected by a token-id test (is it a LENGTH token?) inside `jit`, with no host trip.
Text that merely contains "<promise" (HTML, code) tokenizes to ordinary tokens and never forks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pasta_jax.errors import TagError

LENGTH_STEP = 10
MAX_LENGTH = 500
NUM_LENGTHS = MAX_LENGTH // LENGTH_STEP
# Order of the reserved tokens, from <unused0> (or from `base` in a synthetic vocab).
_LAYOUT = ("promise", "async_open", "async_close", "sync", "apar_fork", "apar_child")
NUM_RESERVED = len(_LAYOUT) + NUM_LENGTHS


@dataclasses.dataclass(frozen=True)
class TagVocab:
  """Token ids of the PASTA-LANG tags and the ids that end a thread."""

  promise: int
  async_open: int
  async_close: int
  sync: int
  apar_fork: int
  apar_child: int
  lengths: tuple[int, ...]  # lengths[i] is the token for tokens=(i + 1) * LENGTH_STEP
  eos_ids: tuple[int, ...]  # any of these ends main (and counts as </async> in a fork)

  @classmethod
  def from_base(cls, base: int, eos_ids: tuple[int, ...]) -> TagVocab:
    """Tags on ids base, base+1, ... (a synthetic vocab, or <unused0>'s id in Gemma)."""
    fixed = {name: base + i for i, name in enumerate(_LAYOUT)}
    start = base + len(_LAYOUT)
    return cls(**fixed, lengths=tuple(range(start, start + NUM_LENGTHS)), eos_ids=tuple(eos_ids))

  @classmethod
  def from_token_lookup(cls, token_to_id, eos_ids: tuple[int, ...]) -> TagVocab:
    """Tags on `<unused0>` ... `<unusedN>` as a tokenizer names them.

    token_to_id: a callable or mapping from token string to id (None if absent).
    """
    lookup = token_to_id.get if hasattr(token_to_id, "get") else token_to_id
    ids = [lookup(f"<unused{i}>") for i in range(NUM_RESERVED)]
    missing = [f"<unused{i}>" for i, t in enumerate(ids) if t is None]
    if missing:
      raise TagError(f"the tokenizer lacks reserved tokens needed for PASTA tags: {missing[:3]}...")
    fixed = dict(zip(_LAYOUT, ids[: len(_LAYOUT)]))
    return cls(**fixed, lengths=tuple(ids[len(_LAYOUT):]), eos_ids=tuple(eos_ids))

  # --- length buckets -------------------------------------------------------------------------
  def length_token(self, tokens: int) -> int:
    """Token for the `tokens` attribute; it must be a multiple of 10 in [10, 500]."""
    if tokens % LENGTH_STEP or not LENGTH_STEP <= tokens <= MAX_LENGTH:
      raise TagError(f'bad tokens="{tokens}": must be a multiple of {LENGTH_STEP} in '
                     f"[{LENGTH_STEP}, {MAX_LENGTH}]")
    return self.lengths[tokens // LENGTH_STEP - 1]

  def length_of(self, token: int) -> int | None:
    """The `tokens` value a LENGTH token stands for, or None for any other token."""
    first = self.lengths[0]
    if first <= token < first + NUM_LENGTHS:
      return (token - first + 1) * LENGTH_STEP
    return None

  def is_length(self, token: int) -> bool:
    return self.length_of(token) is not None

  @property
  def tag_ids(self) -> frozenset[int]:
    return frozenset((self.promise, self.async_open, self.async_close, self.sync, self.apar_fork,
                      self.apar_child) + self.lengths)

  def length_table(self, vocab_size: int) -> np.ndarray:
    """[V] int32: the `tokens` value of each LENGTH token, 0 elsewhere (for use under jit)."""
    table = np.zeros((vocab_size,), np.int32)
    table[list(self.lengths)] = np.arange(1, NUM_LENGTHS + 1) * LENGTH_STEP
    return table


def round_length(num_tokens: int) -> int:
  """True block length -> `tokens` attribute: nearest multiple of 10, clamped to [10, 500]."""
  rounded = int(num_tokens / LENGTH_STEP + 0.5) * LENGTH_STEP  # halves round up, not to even
  return min(MAX_LENGTH, max(LENGTH_STEP, rounded))


def reserved_span(tokens: int) -> int:
  """R: positions main skips for a block: the predicted content plus `<async>` and `</async>`."""
  return tokens + 2
