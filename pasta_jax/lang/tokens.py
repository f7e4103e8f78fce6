"""PASTA-LANG text <-> token ids, and the token-level parser/validator.

  `<promise topic="T" tokens="N"/>`  ->  [PROMISE] + encode(T) + [LENGTH[N]]
  `<async>`, `</async>`, `<sync/>`   ->  ASYNC, ASYNC_END, SYNC (one token each)
  a text segment                     ->  encode(segment), each segment on its own

so every tag boundary is a token boundary. Tokens -> text is the inverse: each tag token becomes
its piece of the tag (PROMISE -> `<promise topic="`, LENGTH[N] -> `" tokens="N"/>`, ...) and each run
of ordinary tokens is decoded on its own. For well-formed ids that reproduces the text form.

A tokenizer is anything with `encode(text) -> list[int]` (no BOS) and `decode(ids) -> str`;
`HFTokenizer` adapts a Hugging Face tokenizer (no BOS, and special-token spellings in the text,
like "<unused0>", stay plain text instead of becoming tag ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from pasta_jax.errors import TagError
from pasta_jax.lang import text as T
from pasta_jax.lang.tags import TagVocab


class Tokenizer(Protocol):
  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


# --- token-level segments ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TokText:
  start: int  # index of the first token in the answer
  ids: tuple[int, ...]

  @property
  def all_ids(self) -> tuple[int, ...]:
    return self.ids


@dataclasses.dataclass(frozen=True)
class TokPromise:
  start: int  # index of PROMISE; the LENGTH token is at start + 1 + len(topic)
  topic: tuple[int, ...]
  tokens: int  # the `tokens` value of its LENGTH token
  length_id: int
  promise_id: int

  @property
  def all_ids(self) -> tuple[int, ...]:
    return (self.promise_id,) + self.topic + (self.length_id,)


@dataclasses.dataclass(frozen=True)
class TokBlock:
  start: int  # index of ASYNC; content from start + 1; ASYNC_END right after it
  content: tuple[int, ...]
  open_id: int
  close_id: int

  @property
  def all_ids(self) -> tuple[int, ...]:
    return (self.open_id,) + self.content + (self.close_id,)


@dataclasses.dataclass(frozen=True)
class TokSync:
  start: int
  sync_id: int

  @property
  def all_ids(self) -> tuple[int, ...]:
    return (self.sync_id,)


TokSegment = TokText | TokPromise | TokBlock | TokSync


def split_end(ids: Sequence[int], vocab: TagVocab) -> tuple[list[int], int | None]:
  """(ids without a final end id, that end id or None)."""
  ids = [int(t) for t in ids]
  if ids and ids[-1] in vocab.eos_ids:
    return ids[:-1], ids[-1]
  return ids, None


def _name(token: int, vocab: TagVocab) -> str:
  names = {vocab.promise: "PROMISE", vocab.async_open: "ASYNC (<async>)", vocab.sync: "SYNC (<sync/>)",
           vocab.async_close: "ASYNC_END (</async>)", vocab.apar_fork: "APAR_FORK",
           vocab.apar_child: "APAR_CHILD"}
  if token in names:
    return f"{names[token]} id {token}"
  if vocab.is_length(token):
    return f"LENGTH[{vocab.length_of(token)}] id {token}"
  if token in vocab.eos_ids:
    return f"end id {token}"
  return f"id {token}"


def _err(index: int, message: str) -> TagError:
  return TagError(f"{message} (token index {index})")


def parse_tokens(ids: Sequence[int], vocab: TagVocab) -> list[TokSegment]:
  """Annotated answer ids -> token segments; raises TagError naming the token index.

  Mirrors `text.parse`: PROMISE topic* LENGTH must be followed directly by ASYNC; a block holds
  only ordinary tokens and ends with ASYNC_END; SYNC only in main. One end id is allowed as the very
  last token (it is not part of any segment); APAR tags and end ids anywhere else are errors.
  """
  ids, _ = split_end(ids, vocab)
  tags = vocab.tag_ids | set(vocab.eos_ids)
  segments: list[TokSegment] = []
  i, n = 0, len(ids)
  while i < n:
    tok = ids[i]
    if tok not in tags:
      j = i
      while j < n and ids[j] not in tags:
        j += 1
      segments.append(TokText(i, tuple(ids[i:j])))
      i = j
    elif tok == vocab.promise:
      j = i + 1
      while j < n and ids[j] not in tags:
        j += 1
      if j == n:
        raise _err(i, "promise not closed by a LENGTH token before the end; PROMISE")
      if not vocab.is_length(ids[j]):
        raise _err(j, f"promise opened at token index {i} is not closed by a LENGTH token: found "
                   f"{_name(ids[j], vocab)}")
      segments.append(TokPromise(i, tuple(ids[i + 1: j]), vocab.length_of(ids[j]), ids[j], tok))
      if j + 1 == n or ids[j + 1] != vocab.async_open:
        found = "the end" if j + 1 == n else _name(ids[j + 1], vocab)
        raise _err(i, f"promise without a block: its LENGTH (index {j}) must be followed directly by ASYNC, "
                   f"found {found}; PROMISE")
      i = j + 1
    elif tok == vocab.async_open:
      if not segments or not isinstance(segments[-1], TokPromise):
        raise _err(i, "block without a promise: ASYNC must directly follow a promise's LENGTH token")
      j = i + 1
      while j < n and ids[j] not in tags:
        j += 1
      if j == n:
        raise _err(i, "unclosed block: no ASYNC_END before the end; ASYNC")
      if ids[j] != vocab.async_close:
        raise _err(j, f"nesting: {_name(ids[j], vocab)} inside the block opened at token index {i}")
      segments.append(TokBlock(i, tuple(ids[i + 1: j]), tok, ids[j]))
      i = j + 1
    elif tok == vocab.sync:
      segments.append(TokSync(i, tok))
      i += 1
    elif tok == vocab.async_close:
      raise _err(i, "stray ASYNC_END outside any block")
    elif vocab.is_length(tok):
      raise _err(i, f"{_name(tok, vocab)} without a PROMISE before it")
    elif tok in vocab.eos_ids:
      raise _err(i, f"{_name(tok, vocab)} before the end of the answer")
    else:
      raise _err(i, f"{_name(tok, vocab)} in a PASTA answer")
  return segments


def promise_topics(main_ids: Sequence[int], vocab: TagVocab) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
  """Main's closed promise topics in order, and its open promise's topic so far (None when none is open).
  A PROMISE inside an open promise starts the topic again (the grammar forbids it; a prompt may hold anything)."""
  closed, current = [], None
  for token in main_ids:
    if token == vocab.promise:
      current = []
    elif current is not None and vocab.is_length(token):
      closed.append(tuple(current))
      current = None
    elif current is not None:
      current.append(token)
  return closed, None if current is None else tuple(current)


def repeats_earlier_topic(main_ids: Sequence[int], vocab: TagVocab) -> bool:
  """Whether main's open promise (a PROMISE with no LENGTH yet) has, so far, exactly the topic of one of main's
  closed promises. Siblings that share a topic see the same context, so greedy decoding writes the same block
  twice; `SamplingConfig.distinct_topics` forbids closing such a topic."""
  closed, current = promise_topics(main_ids, vocab)
  return current is not None and current in closed


def validate_tokens(ids: Sequence[int], vocab: TagVocab) -> None:
  parse_tokens(ids, vocab)


# --- text <-> ids ------------------------------------------------------------------------------------
def _encode_plain(tokenizer: Tokenizer, text: str, vocab: TagVocab, where: str) -> list[int]:
  ids = [int(t) for t in tokenizer.encode(text)] if text else []
  bad = [t for t in ids if t in vocab.tag_ids or t in vocab.eos_ids]
  if bad:
    raise TagError(f"{where}: the tokenizer turned {text[:40]!r} into the tag/end token {bad[0]}; text must "
                   "encode to ordinary tokens")
  return ids


def encode_segments(segments: Sequence[T.Segment], tokenizer: Tokenizer, vocab: TagVocab) -> list[int]:
  T.check_segments(segments)
  ids: list[int] = []
  for i, seg in enumerate(segments):
    where = f"segment {i}"
    if isinstance(seg, T.Text):
      ids += _encode_plain(tokenizer, seg.text, vocab, where)
    elif isinstance(seg, T.Promise):
      topic = _encode_plain(tokenizer, seg.topic, vocab, where)
      ids += [vocab.promise] + topic + [vocab.length_token(seg.tokens)]
    elif isinstance(seg, T.Block):
      ids += [vocab.async_open] + _encode_plain(tokenizer, seg.text, vocab, where) + [vocab.async_close]
    else:
      ids.append(vocab.sync)
  return ids


def encode_answer(answer: str, tokenizer: Tokenizer, vocab: TagVocab) -> list[int]:
  """Promise-form text -> annotated answer ids (no BOS, no end id). Raises TagError on bad text."""
  return encode_segments(T.parse(answer), tokenizer, vocab)


def _tag_piece(token: int, vocab: TagVocab) -> str | None:
  """The text piece a tag token stands for; '' for end ids; None for ordinary tokens."""
  if token == vocab.promise:
    return '<promise topic="'
  if vocab.is_length(token):
    return f'" tokens="{vocab.length_of(token)}"/>'
  pieces = {vocab.async_open: T.ASYNC, vocab.async_close: T.ASYNC_END, vocab.sync: T.SYNC,
            vocab.apar_fork: "", vocab.apar_child: ""}
  if token in pieces:
    return pieces[token]
  return "" if token in vocab.eos_ids else None


def decode_answer(ids: Sequence[int], tokenizer: Tokenizer, vocab: TagVocab, *, strict: bool = True) -> str:
  """Annotated answer ids -> promise-form text (a final end id is dropped).

  strict: validate first (TagError names the token index). With strict=False any id sequence is
  rendered piece by piece (a truncated interpreter output gives e.g. an unclosed `<async>`); end
  ids and APAR tags render as nothing.
  """
  if strict:
    validate_tokens(ids, vocab)
  ids, _ = split_end(ids, vocab)
  parts, run = [], []
  for tok in ids:
    piece = _tag_piece(tok, vocab)
    if piece is None:
      run.append(tok)
      continue
    if run:
      parts.append(tokenizer.decode(run))
      run = []
    parts.append(piece)
  if run:
    parts.append(tokenizer.decode(run))
  return "".join(parts)


def strip_token_ids(ids: Sequence[int], vocab: TagVocab) -> list[int]:
  """The answer's content tokens in sequential order: tags, topics and the end id removed.

  This is the token-level baseline. It can differ from `tokenizer.encode(strip_tags(text))`
  where a merge crosses a tag boundary; Baseline-SFT data should re-encode the stripped text.
  """
  out: list[int] = []
  for seg in parse_tokens(ids, vocab):
    if isinstance(seg, TokText):
      out += seg.ids
    elif isinstance(seg, TokBlock):
      out += seg.content
  return out
