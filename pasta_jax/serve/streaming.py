"""What of a running answer may be streamed: its settled text, which no later step can change.

PASTA answers are built out of order: a fork writes its block while main writes on past the promise, and
the block's text lands where the promise was. So the settled text of a PASTA answer is main's text up to
its first fork that has not closed, then that fork's text so far; main's later text waits until the fork
closes. A sequential answer is a PASTA answer without forks. APAR answers settle only when they end (their
children's texts land between their parents' in tree order), so they are streamed whole at the end.

The last settled token is held back one chunk: a subword tokenizer may merge it with the next one when both
are decoded together, and streamed text can never be taken back. Medusa's accepted paths join main (its
records are main's), so its answers settle as sequential ones do.
"""

from __future__ import annotations

import numpy as np

from pasta_jax.decode.result import clean_text
from pasta_jax.decode.state import THREAD, TOKEN
from pasta_jax.errors import TagError
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.tags import TagVocab


def settled_ids(records: np.ndarray, vocab: TagVocab) -> list[int]:
  """Annotated ids of the settled prefix of a PASTA (or sequential) run, as a well-formed answer: an open
  fork is closed with `</async>`, a promise still waiting for its fork is left out, the end id is dropped,
  and the last content token is held back."""
  by_thread: dict[int, list[int]] = {}
  for row in np.asarray(records):
    by_thread.setdefault(int(row[THREAD]), []).append(int(row[TOKEN]))
  out, promise_at, fork = [], None, 0
  for token in by_thread.get(0, []):
    if token in vocab.eos_ids:
      break
    if token == vocab.promise:
      promise_at = len(out)
    out.append(token)
    if vocab.is_length(token):
      fork += 1
      block = by_thread.get(fork, [])
      if block and block[-1] == vocab.async_close:
        out += block
        promise_at = None
        continue
      content = block[1:-1]  # an open fork (or one not spawned yet): its settled text, last token held back
      return out[:promise_at] if not content else out + [vocab.async_open, *content, vocab.async_close]
  if promise_at is not None:  # a promise whose LENGTH is not written yet: its fork's text will land there
    out = out[:promise_at]
  return out[:-1] if out and out[-1] not in vocab.tag_ids else out


def settled_text(records: np.ndarray, tokenizer, vocab: TagVocab, streams: bool) -> str:
  """The clean text of the settled prefix ("" for a method that settles only at the end: `streams` False, its
  `Capabilities.stream`)."""
  if not streams:
    return ""
  ids = settled_ids(records, vocab)
  try:
    annotated = tok.decode_answer(ids, tokenizer, vocab)
  except TagError:  # a malformed prefix (a model writing broken tags): settle nothing yet
    return ""
  return clean_text(ids, annotated, tokenizer, vocab)


def delta(sent: str, text: str) -> str | None:
  """The new part of `text` after what was `sent`, without a trailing partial character; None if `text`
  does not extend `sent` (the stream cannot take text back)."""
  if not text.startswith(sent):
    return None
  return text[len(sent):].rstrip("\ufffd")
