"""APAR's training layout (the APAR paper, section 2.2) with the same Layout, mask and loss as PASTA.

Tokens are laid out in tree order (write order = index): the prompt, then main's answer with each
child (its inserted APAR_CHILD, its tokens, its end id) right after the fork that spawns it.
  - Positions: exact path positions. The child's APAR_CHILD and the parent's next token both take
    the fork's position + 1; nothing is reserved.
  - Horizons: every token sees its own thread causally and what its parent saw at the fork, the fork
    included; nobody sees a child (no sync). Children are numbered in tree order.
  - Targets follow each thread's own stream: main = prompt, answer, end id; a child = APAR_CHILD,
    its tokens, its end id. Nothing predicts APAR_CHILD (attended to, never learned, as the paper
    says), and end ids predict nothing. Loss: every target that is an answer token.
The interpreter's APAR mode replays such an answer with the same logits (tests/test_apar_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from pasta_jax.errors import PastaError
from pasta_jax.lang.apar_tree import Node, parse_tree
from pasta_jax.lang.layout import Layout, filled_layout, fitted_shape, horizons_from_views
from pasta_jax.lang.tags import TagVocab


class _Rows:
  def __init__(self):
    self.tokens, self.positions, self.thread, self.view = [], [], [], []
    self.streams: list[list[int]] = []

  def add(self, token: int, position: int, thread: int, view: dict[int, int]) -> int:
    index = len(self.tokens)
    self.tokens.append(int(token))
    self.positions.append(position)
    self.thread.append(thread)
    self.view.append({**view, thread: index})  # causal on its own thread
    self.streams[thread].append(index)
    return index


def _lay_out(rows: _Rows, node: Node, thread: int, position: int, view: dict[int, int], vocab: TagVocab,
             end_id: int) -> None:
  children = iter(node.children)
  for token in node.tokens:
    index = rows.add(token, position, thread, view)
    position += 1
    if token == vocab.apar_fork:
      child = next(children, None)
      if child is not None:
        child_thread = len(rows.streams)
        rows.streams.append([])
        child_view = {**view, thread: index}
        rows.add(vocab.apar_child, position, child_thread, child_view)
        _lay_out(rows, child, child_thread, position + 1, child_view, vocab, end_id)
  rows.add(end_id, position, thread, view)


def apar_layout(prompt_ids: Sequence[int], tree_ids: Sequence[int], vocab: TagVocab, *, eos_id: int | None = None,
                length: int | None = None, num_threads: int | None = None, pad_id: int = 0) -> Layout:
  """Prompt ids + tree-order answer ids (decode.apar_text.encode_apar_text) -> the APAR layout.

  Children must end with an end id (their `</child>`); main's end id is `eos_id` (default the
  vocab's first). Raises TagError naming the token for a malformed tree.
  """
  if len(prompt_ids) == 0:
    raise PastaError("empty prompt: a layout needs at least one prompt token to predict the answer's first")
  end = vocab.eos_ids[0] if eos_id is None else eos_id
  rows = _Rows()
  rows.streams.append([])
  for i, token in enumerate(prompt_ids):
    rows.add(token, i, 0, {})
  _lay_out(rows, parse_tree(tree_ids, vocab), 0, len(prompt_ids), {}, vocab, end)
  return _arrays(rows, len(prompt_ids), length, num_threads, pad_id)


def _arrays(rows: _Rows, num_prompt: int, length: int | None, num_threads: int | None, pad_id: int) -> Layout:
  n = len(rows.tokens)
  length, num_threads = fitted_shape(n, len(rows.streams), length, num_threads)
  horizon = horizons_from_views(rows.view, length, num_threads)
  return filled_layout(rows.tokens, rows.positions, rows.thread, horizon, rows.streams, num_prompt, pad_id)
