"""PASTA-LANG tags as single tokens.

Tags map onto reserved tokens the Gemma vocabularies already have (`<unused0>` ...), so
embeddings need no resizing and checkpoints stay compatible with stock ones:

  `<promise topic="`              PROMISE        then the topic as plain text tokens
  `" tokens="N"/>`                LENGTH[N]      one token per bucket N = 10, 20, ..., 500;
                                                 it closes the promise and triggers the fork
  `<async>` `</async>` `<sync/>`  ASYNC, ASYNC_END, SYNC
  APAR's fork and child tokens    APAR_FORK, APAR_CHILD
  the earlier paper's scoped form SCOPE `<scope>`, SCOPE_END `</scope>`, BARE_PROMISE `<promise/>`
                                 (reserved after the LENGTH tokens, so the ids above never moved)

A fork is detected by a token-id test (is it a LENGTH token?) inside `jit`, with no host trip.
Text that merely contains "<promise" (HTML, code) tokenizes to ordinary tokens and never forks.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pasta_jax.errors import TagError
from pasta_jax.lang import schema

LENGTH_STEP = 10
MAX_LENGTH = 500
NUM_LENGTHS = MAX_LENGTH // LENGTH_STEP
# Order of the reserved tokens, from <unused0> (or from `base` in a synthetic vocab).
_LAYOUT = ("promise", "async_open", "async_close", "sync", "apar_fork", "apar_child")
# The scoped form's tags come after the LENGTH tokens: adding them moved no id that trained adapters use.
_SCOPED_LAYOUT = ("scope_open", "scope_close", "bare_promise")
NUM_RESERVED = len(_LAYOUT) + NUM_LENGTHS + len(_SCOPED_LAYOUT)


@dataclasses.dataclass(frozen=True)
class TagVocab:
  """Token ids of the PASTA-LANG tags and the ids that end a thread."""

  promise: int
  async_open: int
  async_close: int
  sync: int
  apar_fork: int
  apar_child: int
  lengths: tuple[int, ...]  # lengths[i] is the token for tokens=(i + 1) * length_step
  eos_ids: tuple[int, ...]  # any of these ends main (and counts as </async> in a fork)
  scope_open: int  # `<scope>` (the scoped form, pasta_jax.lang.scoped)
  scope_close: int  # `</scope>`
  bare_promise: int  # `<promise/>`: the scoped form's attribute-less promise; it forks at once
  length_step: int = LENGTH_STEP  # 10: Pred-10x buckets (the default); 1: one token per exact length (Pred-1x)

  def __post_init__(self):
    if MAX_LENGTH % self.length_step or len(self.lengths) != MAX_LENGTH // self.length_step:
      raise TagError(f"a length step of {self.length_step} needs {MAX_LENGTH // self.length_step} LENGTH tokens, "
                     f"got {len(self.lengths)}")

  @classmethod
  def from_base(cls, base: int, eos_ids: tuple[int, ...], length_step: int = LENGTH_STEP) -> TagVocab:
    """Tags on ids base, base+1, ... (a synthetic vocab, or <unused0>'s id in Gemma)."""
    fixed = {name: base + i for i, name in enumerate(_LAYOUT)}
    start = base + len(_LAYOUT)
    end = start + MAX_LENGTH // length_step
    scoped = {name: end + i for i, name in enumerate(_SCOPED_LAYOUT)}
    return cls(**fixed, **scoped, lengths=tuple(range(start, end)), eos_ids=tuple(eos_ids),
               length_step=length_step)

  @classmethod
  def from_token_lookup(cls, token_to_id, eos_ids: tuple[int, ...], length_step: int = LENGTH_STEP) -> TagVocab:
    """Tags on `<unused0>` ... `<unusedN>` as a tokenizer names them (N = 58 for 10-token length
    buckets; 508 for one LENGTH token per exact length, which Gemma 3's vocabulary has room for).

    token_to_id: a callable or mapping from token string to id (None if absent).
    """
    lookup = token_to_id.get if hasattr(token_to_id, "get") else token_to_id
    num_lengths = MAX_LENGTH // length_step
    ids = [lookup(f"<unused{i}>") for i in range(len(_LAYOUT) + num_lengths + len(_SCOPED_LAYOUT))]
    missing = [f"<unused{i}>" for i, t in enumerate(ids) if t is None]
    if missing:
      raise TagError(f"the tokenizer lacks {len(missing)} reserved tokens needed for PASTA tags with a length "
                     f"step of {length_step}: {missing[:3]}...")
    end = len(_LAYOUT) + num_lengths
    lengths = tuple(ids[len(_LAYOUT):end])  # not always consecutive ids (Gemma 3's <unused*> are not)
    fixed = dict(zip(_LAYOUT, ids[: len(_LAYOUT)]))
    scoped = dict(zip(_SCOPED_LAYOUT, ids[end:]))
    return cls(**fixed, **scoped, lengths=lengths, eos_ids=tuple(eos_ids), length_step=length_step)

  # --- length buckets -------------------------------------------------------------------------
  def length_token(self, tokens: int) -> int:
    """Token for the `tokens` attribute; a multiple of the length step (10, or 1) in [step, 500]."""
    step = self.length_step
    if tokens % step or not step <= tokens <= MAX_LENGTH:
      raise TagError(f'bad tokens="{tokens}": must be a multiple of {step} in [{step}, {MAX_LENGTH}]')
    return self.lengths[tokens // step - 1]

  def length_of(self, token: int) -> int | None:
    """The `tokens` value a LENGTH token stands for, or None for any other token."""
    index = self._length_index.get(token)
    return None if index is None else (index + 1) * self.length_step

  @functools.cached_property
  def _length_index(self) -> dict[int, int]:
    return {token: i for i, token in enumerate(self.lengths)}

  @property
  def no_length(self) -> int:
    """The one LENGTH token a tag-less promise closes with ("oracle-tagless": the tag says no length,
    but a token must still close the promise and trigger the fork)."""
    return self.lengths[0]

  def is_length(self, token: int) -> bool:
    return self.length_of(token) is not None

  @property
  def tag_ids(self) -> frozenset[int]:
    return frozenset((self.promise, self.async_open, self.async_close, self.sync, self.apar_fork,
                      self.apar_child) + self.lengths + self.scoped_tags)

  @property
  def scoped_tags(self) -> tuple[int, ...]:
    """The scoped form's own tags (it shares `<async>` and `</async>` with the later form)."""
    return (self.scope_open, self.scope_close, self.bare_promise)

  def length_table(self, vocab_size: int) -> np.ndarray:
    """[V] int32: the `tokens` value of each LENGTH token, 0 elsewhere (for use under jit)."""
    table = np.zeros((vocab_size,), np.int32)
    table[list(self.lengths)] = np.arange(1, len(self.lengths) + 1) * self.length_step
    return table


def tag_vocab_for(tokenizer, position_mode: str) -> TagVocab:
  """A tokenizer's tag vocabulary for a position mode: 10-token length buckets, or (Pred-1x) one LENGTH
  token per exact length. A tokenizer that only knows the buckets is asked without an argument."""
  step = schema.length_step(position_mode)
  return tokenizer.tag_vocab() if step == LENGTH_STEP else tokenizer.tag_vocab(length_step=step)


def round_length(num_tokens: int) -> int:
  """True block length -> `tokens` attribute: nearest multiple of 10 (halves up), clamped to [10, 500]."""
  return schema.round_to_ten(int(num_tokens))


def reserved_span(tokens: int) -> int:
  """R: positions main skips for a block: the predicted content plus `<async>` and `</async>`."""
  return tokens + 2
