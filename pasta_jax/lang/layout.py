"""Training layout of one annotated example (DESIGN section 2; docs/interpreter.md mirrored exactly).

The layout is the annotated order: prompt, then the answer with each fork's tokens
(`<async>` content `</async>`) right after its promise's LENGTH token, then an end id for main.
Write order = index. Every token gets an owner thread (0 = main; forks 1, 2, ... in promise order),
a position and a horizon row; the attention mask is `pasta_jax.visibility.visible` over them.

Positions: the prompt takes 0 .. P-1 and main goes on from P. The `<async>` of a block takes p + 1
(p = the position of its promise's LENGTH token); main's next token takes p + 1 + R with
R = reserved_span(block length), the block length being `tokens` (mode "pred"), 40 ("fixed") or the
true content length ("oracle"). Never re-based after a sync.

Visibility (horizon rows): every token sees its own thread causally (horizon = its own index).
A fork sees main up to its promise's LENGTH token, plus every fork main had synced before that
(`UNBOUNDED`, as the interpreter sets them). Main sees a fork from the first `<sync/>` after it on
(the `<sync/>` itself included), never before.

Targets follow each thread's own stream: main = prompt, main's answer tokens, end id; a fork =
`<async>`, content, `</async>`. So the LENGTH token predicts the first main token after the block
(or the end id), `<async>` predicts the first content token, the last content token predicts
`</async>`, `</async>` and the final end id predict nothing, and nothing predicts `<async>`.
Loss: every target that is an answer token (the end id included). Prompt tokens predicting prompt
tokens carry none; the prompt's last token carries loss because its target, the first answer
token, is what the interpreter samples at step 0 from those very logits. Where there is nothing to
predict, targets hold 0 (a safe gather index) and loss_mask is False.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import PastaError
from pasta_jax.lang import schema
from pasta_jax.lang.tags import MAX_LENGTH, TagVocab, reserved_span
from pasta_jax.lang.tokens import (
  TokBlock,
  TokPromise,
  TokSegment,
  TokSync,
  TokText,
  parse_tokens,
  split_end,
  strip_token_ids,
)
from pasta_jax.visibility import HIDDEN, UNBOUNDED, ThreadMask, visible

PositionMode = schema.PositionMode
FIXED_BLOCK_LENGTH = schema.FIXED_BLOCK_LENGTH
NO_TARGET = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layout:
  """One example ([L] arrays) or a batch ([B, L], from `stack_layouts`)."""

  tokens: np.ndarray  # [..., L] int32
  positions: np.ndarray  # [..., L] int32
  thread: np.ndarray  # [..., L] int32 owner thread
  order: np.ndarray  # [..., L] int32 write order (= index)
  valid: np.ndarray  # [..., L] bool (False on padding)
  horizon: np.ndarray  # [..., L, U] int32 (pasta_jax.visibility)
  targets: np.ndarray  # [..., L] int32 next token of the same thread's stream (NO_TARGET if none)
  loss_mask: np.ndarray  # [..., L] bool

  @property
  def length(self) -> int:
    return self.tokens.shape[-1]

  @property
  def num_threads(self) -> int:
    return self.horizon.shape[-1]

  def mask(self) -> jax.Array:
    return mask(self)

  def thread_mask(self) -> ThreadMask:
    """The metadata the mask comes from, as the model takes it (a kernel then never builds the mask)."""
    return ThreadMask(jnp.asarray(self.horizon), jnp.asarray(self.thread), jnp.asarray(self.order),
                      jnp.asarray(self.valid))


def mask(layout: Layout) -> jax.Array:
  """[..., L, L] bool attention mask: query row i may see key j. The one rule, nothing else."""
  return visible(jnp.asarray(layout.horizon), jnp.asarray(layout.thread), jnp.asarray(layout.order),
                 jnp.asarray(layout.valid))


def block_length(mode: PositionMode, promise: TokPromise, block: TokBlock) -> int:
  """The block length R is reserved for (R = reserved_span of it): `schema.block_length`."""
  try:
    return schema.block_length(mode, lambda: promise.tokens, lambda: len(block.content))
  except ValueError as err:
    raise PastaError(str(err)) from None


def tagged_promise(mode: PositionMode, promise: TokPromise, block: TokBlock, vocab: TagVocab) -> TokPromise:
  """The promise as the mode trains it: Pred-1x tags the block's exact length (on a vocabulary with
  one LENGTH token per length), the tag-less oracle closes every promise with the one `no_length`
  token; every other mode keeps the annotated 10-token bucket."""
  if mode == "pred-1x":
    if vocab.length_step != 1:
      raise PastaError("position mode 'pred-1x' tags exact block lengths: it needs a tag vocabulary with one "
                       "LENGTH token per length (tokenizer.tag_vocab(length_step=1))")
    exact = min(MAX_LENGTH, max(1, len(block.content)))
    return dataclasses.replace(promise, tokens=exact, length_id=vocab.length_token(exact))
  if mode == "oracle-tagless":
    return dataclasses.replace(promise, tokens=vocab.length_of(vocab.no_length), length_id=vocab.no_length)
  return promise


def answer_for_mode(answer_ids: Sequence[int], vocab: TagVocab, mode: PositionMode) -> list[int]:
  """The annotated answer as `mode` trains it: each promise's LENGTH per `tagged_promise`, every other
  token unchanged (what a model trained in that mode writes, so forced replays use it too)."""
  answer, end = split_end(answer_ids, vocab)
  segments = parse_tokens(answer, vocab)
  ids: list[int] = []
  for k, seg in enumerate(segments):
    ids += tagged_promise(mode, seg, segments[k + 1], vocab).all_ids if isinstance(seg, TokPromise) else seg.all_ids
  return ids + ([end] if end is not None else [])


@dataclasses.dataclass
class _Rows:
  """Per-token lists while laying out (index = write order)."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  positions: list[int] = dataclasses.field(default_factory=list)
  thread: list[int] = dataclasses.field(default_factory=list)
  main_limit: list[int] = dataclasses.field(default_factory=list)  # horizon on main (own index for main)
  synced: list[int] = dataclasses.field(default_factory=list)  # forks 1..synced are seen in full

  def add(self, token: int, position: int, thread: int, main_limit: int | None, synced: int) -> int:
    index = len(self.tokens)
    self.tokens.append(int(token))
    self.positions.append(position)
    self.thread.append(thread)
    self.main_limit.append(index if main_limit is None else main_limit)
    self.synced.append(synced)
    return index


def _lay_out(prompt: Sequence[int], segments: Sequence[TokSegment], end_id: int, mode: PositionMode,
             vocab: TagVocab | None):
  """Rows plus the per-thread streams (lists of indices) for the targets."""
  if len(prompt) == 0:
    raise PastaError("empty prompt: a layout needs at least one prompt token to predict the answer's first")
  rows = _Rows()
  main = [rows.add(t, i, 0, None, 0) for i, t in enumerate(prompt)]
  forks: list[list[int]] = []
  next_pos, synced = len(prompt), 0  # synced: forks 1..synced are visible to main
  for k, seg in enumerate(segments):
    if isinstance(seg, TokBlock):
      continue  # laid out with its promise
    if isinstance(seg, TokSync):
      synced = len(forks)  # the <sync/> itself already sees them
    if isinstance(seg, TokPromise):
      seg = tagged_promise(mode, seg, segments[k + 1], vocab)
    for token in seg.all_ids:
      main.append(rows.add(token, next_pos, 0, None, synced))
      next_pos += 1
    if isinstance(seg, TokPromise):
      block = segments[k + 1]
      length_pos, length_index, thread = next_pos - 1, main[-1], len(forks) + 1
      stream = [rows.add(t, length_pos + 1 + j, thread, length_index, synced)
                for j, t in enumerate(block.all_ids)]
      forks.append(stream)
      next_pos = length_pos + 1 + reserved_span(block_length(mode, seg, block))
  main.append(rows.add(end_id, next_pos, 0, None, synced))
  return rows, main, forks


def _arrays(rows: _Rows, main: list[int], forks: list[list[int]], num_prompt: int, length: int | None,
            num_threads: int | None, pad_id: int) -> Layout:
  n = len(rows.tokens)
  length = n if length is None else length
  num_threads = 1 + len(forks) if num_threads is None else num_threads
  if n > length:
    raise PastaError(f"example needs {n} tokens but the layout length is {length}")
  if 1 + len(forks) > num_threads:
    raise PastaError(f"example has {1 + len(forks)} threads but the layout allows {num_threads}")
  horizon = np.full((length, num_threads), HIDDEN, np.int32)
  for i in range(n):
    horizon[i, 1: 1 + rows.synced[i]] = UNBOUNDED
    horizon[i, 0] = rows.main_limit[i]
    horizon[i, rows.thread[i]] = i  # causal on its own thread
  return filled_layout(rows.tokens, rows.positions, rows.thread, horizon, [main] + forks, num_prompt, pad_id)


def filled_layout(tokens: Sequence[int], positions: Sequence[int], thread: Sequence[int], horizon: np.ndarray,
                  streams: Sequence[Sequence[int]], num_prompt: int, pad_id: int) -> Layout:
  """The Layout of n laid-out rows, padded to the [L, U] `horizon`'s L (a layout builder's last step)."""
  n, length = len(tokens), horizon.shape[0]

  def padded(values, fill):
    out = np.full((length,), fill, np.int32)
    out[:n] = values
    return out

  targets, loss_mask = stream_targets(tokens, streams, num_prompt, length)
  return Layout(tokens=padded(tokens, pad_id), positions=padded(positions, 0), thread=padded(thread, 0),
                order=np.arange(length, dtype=np.int32), valid=np.arange(length) < n, horizon=horizon,
                targets=targets, loss_mask=loss_mask)


def fitted_shape(tokens: int, threads: int, length: int | None, num_threads: int | None) -> tuple[int, int]:
  """(L, U) of a layout of `tokens` x `threads` padded to `length` x `num_threads` (None: exactly its own)."""
  length = tokens if length is None else length
  num_threads = threads if num_threads is None else num_threads
  if tokens > length or threads > num_threads:
    raise PastaError(f"example needs {tokens} tokens x {threads} threads; the layout allows {length} x {num_threads}")
  return length, num_threads


def horizons_from_views(views: Sequence[dict[int, int]], length: int, num_threads: int) -> np.ndarray:
  """[L, U] int32 horizons from each token's view (thread -> horizon), HIDDEN where a view names no thread."""
  horizon = np.full((length, num_threads), HIDDEN, np.int32)
  for i, view in enumerate(views):
    for thread, limit in view.items():
      horizon[i, thread] = limit
  return horizon


def stream_targets(tokens: Sequence[int], streams: Sequence[Sequence[int]], num_prompt: int,
                   length: int) -> tuple[np.ndarray, np.ndarray]:
  """Each token's target is the next token of its own thread's stream (indices into `tokens`);
  loss on every target that is an answer token. Returns [length] targets and loss mask."""
  targets = np.full((length,), NO_TARGET, np.int32)
  loss_mask = np.zeros((length,), bool)
  for stream in streams:
    for a, b in zip(stream[:-1], stream[1:], strict=True):
      targets[a] = tokens[b]
      loss_mask[a] = b >= num_prompt
  return targets, loss_mask


def layout_example(prompt_ids: Sequence[int], answer_ids: Sequence[int], vocab: TagVocab, *,
                   length: int | None = None, num_threads: int | None = None, mode: PositionMode = "pred",
                   eos_id: int | None = None, pad_id: int = 0) -> Layout:
  """Prompt ids (BOS/chat template included) + annotated answer ids -> the PASTA training layout.

  The answer may end with an end id; otherwise `eos_id` (default vocab.eos_ids[0]) is appended to
  main. length / num_threads pad to L / U (default: exactly what the example needs). Raises
  TagError (naming the token index) for a malformed answer.
  """
  answer, end = split_end(answer_ids, vocab)
  end = end if end is not None else (vocab.eos_ids[0] if eos_id is None else eos_id)
  rows, main, forks = _lay_out(prompt_ids, parse_tokens(answer, vocab), end, mode, vocab)
  return _arrays(rows, main, forks, len(prompt_ids), length, num_threads, pad_id)


def plain_layout(prompt_ids: Sequence[int], answer_ids: Sequence[int], eos_id: int, *,
                 length: int | None = None, num_threads: int = 1, pad_id: int = 0) -> Layout:
  """Plain causal layout (one thread): prompt, answer, eos. Equals `layout_example` on a tag-free answer."""
  segments = [TokText(0, tuple(int(t) for t in answer_ids))] if len(answer_ids) else []
  rows, main, forks = _lay_out(prompt_ids, segments, eos_id, "pred", None)  # no promises: no vocab needed
  return _arrays(rows, main, forks, len(prompt_ids), length, num_threads, pad_id)


def baseline_layout(prompt_ids: Sequence[int], answer_ids: Sequence[int], vocab: TagVocab, *,
                    length: int | None = None, num_threads: int = 1, eos_id: int | None = None,
                    pad_id: int = 0) -> Layout:
  """Baseline-SFT layout: the same answer with every annotation removed, laid out causally.

  Token-level strip (`strip_token_ids`); re-encode `text.strip_tags(text)` instead where the exact
  sequential tokenization matters.
  """
  _, end = split_end(answer_ids, vocab)
  end = end if end is not None else (vocab.eos_ids[0] if eos_id is None else eos_id)
  return plain_layout(prompt_ids, strip_token_ids(answer_ids, vocab), end, length=length,
                      num_threads=num_threads, pad_id=pad_id)


# --- batching ----------------------------------------------------------------------------------------
def pad_layout(layout: Layout, length: int, num_threads: int, pad_id: int = 0) -> Layout:
  """One [L] layout padded to `length` tokens and `num_threads` horizon columns."""
  n, u = layout.length, layout.num_threads
  if n > length or u > num_threads:
    raise PastaError(f"cannot pad a layout of {n} tokens x {u} threads to {length} x {num_threads}")

  def grow(array, fill):
    out = np.full((length,) + array.shape[1:], fill, array.dtype)
    out[:n] = array
    return out

  horizon = np.full((length, num_threads), HIDDEN, np.int32)
  horizon[:n, :u] = layout.horizon
  return Layout(tokens=grow(layout.tokens, pad_id), positions=grow(layout.positions, 0),
                thread=grow(layout.thread, 0), order=np.arange(length, dtype=np.int32),
                valid=grow(layout.valid, False), horizon=horizon, targets=grow(layout.targets, NO_TARGET),
                loss_mask=grow(layout.loss_mask, False))


def stack_layouts(layouts: Sequence[Layout], length: int | None = None, num_threads: int | None = None,
                  pad_id: int = 0) -> Layout:
  """[L] layouts -> one [B, L] layout, padded to the longest (or `length`) and the most threads."""
  if not layouts:
    raise PastaError("no layouts to stack")
  length = max(x.length for x in layouts) if length is None else length
  num_threads = max(x.num_threads for x in layouts) if num_threads is None else num_threads
  padded = [pad_layout(x, length, num_threads, pad_id) for x in layouts]
  fields = [f.name for f in dataclasses.fields(Layout)]
  return Layout(**{name: np.stack([getattr(x, name) for x in padded]) for name in fields})
