"""Training layout of one scoped (earlier-paper) example: mask and positions from the one visibility rule.

The layout is the annotated order: prompt, then the answer with `<async>` written right after each
`<promise/>` and the block after it, then main's end id. Write order = index. Threads: main is 0, the
blocks are 1, 2, ... in text order (preorder: a block's own blocks follow it).

Horizons (what each token's query sees), the synchronous prefixes of the paper's four cases, as the
interpreter builds them (docs/interpreter.md, "Scoped mode"; tags included, as written in the cache):
  - its own thread causally; what its spawner saw at its `<promise/>` (the promise included);
  - from a `</scope>` on (the `</scope>` included): every token of every block started inside that scope,
    and of their own blocks.
Positions: a token's position is the size of its synchronous prefix: the number of tokens the query that
predicted it saw (itself included). A block's `<async>` sits at |V(promise)|, as does the token after the
block in its spawner's stream; the token after `</scope>` counts the synced blocks.
Targets follow each thread's stream (main: prompt, answer, end id; a block: `<async>`, content, `</async>`),
so the promise predicts its spawner's next token, and nothing predicts `<async>`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pasta_jax.errors import PastaError
from pasta_jax.lang.layout import Layout, fitted_shape, horizons_from_views, stream_targets
from pasta_jax.lang.scoped import Fork, Item, Scope, descendants, parse_tokens
from pasta_jax.lang.tags import TagVocab
from pasta_jax.visibility import UNBOUNDED, visible


@dataclasses.dataclass
class _Walk:
  vocab: TagVocab
  tokens: list[int] = dataclasses.field(default_factory=list)
  owner: list[int] = dataclasses.field(default_factory=list)
  rows: list[dict[int, int]] = dataclasses.field(default_factory=list)  # per token: thread -> horizon
  streams: list[list[int]] = dataclasses.field(default_factory=list)  # per thread: its token indices
  spawned_at: dict[int, int] = dataclasses.field(default_factory=dict)  # thread -> its promise's index
  children: dict[int, list[int]] = dataclasses.field(default_factory=dict)

  def emit(self, token: int, thread: int, view: dict[int, int]) -> int:
    index = len(self.tokens)
    self.tokens.append(int(token))
    self.owner.append(thread)
    self.rows.append({**view, thread: index})
    self.streams[thread].append(index)
    return index

  def new_thread(self, parent: int) -> int:
    thread = len(self.streams)
    self.streams.append([])
    self.children[thread] = []
    if parent >= 0:
      self.children[parent].append(thread)
    return thread

  def subtree(self, roots: list[int]) -> set[int]:
    return descendants(roots, self.children)

  def thread(self, items: Sequence[Item], thread: int, view: dict[int, int], scopes: list[list[int]]) -> None:
    """Lays out one thread's items; `view` is its horizon on other threads (it grows at each `</scope>`)."""
    vocab = self.vocab
    for item in items:
      if isinstance(item, Scope):
        self.emit(vocab.scope_open, thread, view)
        scopes.append([])
        self.thread(item.body, thread, view, scopes)
        view.update({u: UNBOUNDED for u in self.subtree(scopes.pop())})
        self.emit(vocab.scope_close, thread, view)
      elif isinstance(item, Fork):
        promise = self.emit(vocab.bare_promise, thread, view)
        child = self.new_thread(thread)
        self.spawned_at[child] = promise
        for scope in scopes:
          scope.append(child)
        child_view = {**view, thread: promise}
        self.emit(vocab.async_open, child, child_view)
        self.thread(item.block, child, child_view, [])
        self.emit(vocab.async_close, child, child_view)
      else:
        for token in item:
          self.emit(token, thread, view)


def scoped_layout(prompt_ids: Sequence[int], answer_ids: Sequence[int], vocab: TagVocab, *,
                  eos_id: int | None = None, length: int | None = None, num_threads: int | None = None,
                  pad_id: int = 0) -> Layout:
  """Prompt ids + scoped answer ids (an end id at the end optional) -> the training layout, padded to
  `length` tokens and `num_threads` threads when given. TagError (naming the token) for a malformed answer."""
  if len(prompt_ids) == 0:
    raise PastaError("empty prompt: a layout needs at least one prompt token to predict the answer's first")
  answer = [int(t) for t in answer_ids]
  end = answer.pop() if answer and answer[-1] in vocab.eos_ids else (vocab.eos_ids[0] if eos_id is None else eos_id)
  walk = _Walk(vocab)
  walk.new_thread(-1)
  view: dict[int, int] = {}
  for token in prompt_ids:
    walk.emit(token, 0, view)
  walk.thread(parse_tokens(answer, vocab), 0, view, [])
  walk.emit(end, 0, view)
  return _arrays(walk, len(prompt_ids), length, num_threads, pad_id)


def _arrays(walk: _Walk, num_prompt: int, length: int | None, num_threads: int | None, pad_id: int) -> Layout:
  n = len(walk.tokens)
  length, num_threads = fitted_shape(n, len(walk.streams), length, num_threads)
  horizon = horizons_from_views(walk.rows, length, num_threads)
  owner = np.zeros((length,), np.int32)
  owner[:n] = walk.owner
  valid = np.arange(length) < n
  order = np.arange(length, dtype=np.int32)
  seen = np.asarray(visible(horizon, owner, order, valid)).sum(axis=-1)  # [L] |V(query)|
  positions = np.zeros((length,), np.int32)
  for thread, stream in enumerate(walk.streams):
    positions[stream[0]] = 0 if thread == 0 else seen[walk.spawned_at[thread]]
    for a, b in zip(stream[:-1], stream[1:], strict=True):
      positions[b] = seen[a]
  tokens = np.full((length,), pad_id, np.int32)
  tokens[:n] = walk.tokens
  targets, loss_mask = stream_targets(walk.tokens, walk.streams, num_prompt, length)
  return Layout(tokens=tokens, positions=positions, thread=owner, order=order, valid=valid, horizon=horizon,
                targets=targets, loss_mask=loss_mask)
