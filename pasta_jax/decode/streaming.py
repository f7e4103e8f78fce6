"""What of a running answer may be streamed: its settled text, a prefix of its final text whatever comes next.

Streamed text can never be taken back, so the settled text of a run's records so far must be a prefix of the
text its result will have (`decode.result.pasta_result`, the result of every method that streams), for every way
the run can go on. That text is cleaned from the annotated answer, each fork's block spliced in after the LENGTH
that spawned it, tags and promise topics dropped, in one of two ways that only the end decides
(`result.clean_text`): where the answer, rendered in promise form (leniently if the run was cut off), reads back,
its text runs (the ids between two tags) are decoded one by one and `strip_tags` joins them; where it does not (a
model writing stray tags, a promise whose block no fork writes), the content ids are decoded together. So the
settled text is the common prefix of both, over the settled ids:

- PASTA answers are built out of order: a fork writes its block while main writes on past the promise, and the
  block's text lands where the promise was. So the settled ids are main's up to its first fork that has not
  closed, then that fork's so far; main's later text waits until the fork closes. A promise whose LENGTH main
  wrote past with no fork started (a method that never forks, sequential or Medusa, decoding a PASTA model) has
  no block: main's text goes on after it. A promise still open (no LENGTH yet) holds back all after it (its topic
  is no text, and its block will land there).
- the last content id is held back (a subword detokenizer may merge it with the next one when both are decoded
  together), and so are trailing ids that alone decode to a partial character (byte pieces: the next id may
  complete the character, or make replacement marks of the whole group).
- text that may still become a tag (`<promise`, `<async`, `<sync`, or the start of one, written as plain text)
  waits: `strip_tags` may drop or refuse it.
- where the two cleanings may differ for good, nothing after settles before the end: a promise whose rendered tag
  does not read back as one (a topic with `"`, `<`, `>` or a tag: a rendering that reads back keeps it as plain
  text), a LENGTH that closes no promise (kept as `" tokens="N"/>`), a scoped-form tag (decoded as a token).

A sequential answer is a PASTA answer without forks; Medusa's accepted paths join main (its records are main's),
so its answers settle as sequential ones do. APAR answers settle only when they end (their children's texts land
between their parents' in tree order), so they are streamed whole at the end.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from pasta_jax.decode.state import THREAD, TOKEN
from pasta_jax.lang.tags import TagVocab

TAG_NAMES = ("promise", "async", "sync")
# Plain text that reads as a tag, or as a near miss `strip_tags` refuses (`lang.text.NEAR_MISS_PATTERN`).
TAG_LIKE = re.compile(r"<\s*/?\s*(?:promise|async|sync)\b", re.IGNORECASE)
TAG_START = re.compile(r"<\s*/?\s*([a-z]*)\Z", re.IGNORECASE)  # a `<` at the end that more text may make a tag


def settled_ids(records: np.ndarray, vocab: TagVocab) -> list[int]:
  """Annotated ids of the settled prefix of a PASTA (or sequential) run, spliced as `metrics.annotated_from_records`
  splices them: an open fork is closed with `</async>`, a promise still waiting for its LENGTH or its fork is left
  out, the end id is dropped, and the last content token is held back. A scoped-form tag or a LENGTH outside a
  promise (which the result's two cleanings render differently) settles nothing after it."""
  by_thread: dict[int, list[int]] = {}
  for row in np.asarray(records):
    by_thread.setdefault(int(row[THREAD]), []).append(int(row[TOKEN]))
  main = by_thread.get(0, [])
  out, promise_at, fork = [], None, 0
  for i, token in enumerate(main):
    if token in vocab.eos_ids or token in vocab.scoped_tags:
      break
    if token == vocab.promise and promise_at is None:  # a topic runs on to the next LENGTH (`result.content_ids`)
      promise_at = len(out)
    if vocab.is_length(token) and promise_at is None:  # a LENGTH that closes no promise: malformed answers render
      break  # it as text (`" tokens="N"/>`) where their tags read back, and drop it where they do not
    out.append(token)
    if not vocab.is_length(token):
      continue
    fork += 1
    block = by_thread.get(fork)
    if block is None and i + 1 < len(main):  # main wrote on with no fork started: none will (a fork starts in the
      promise_at = None  # step that feeds its LENGTH, as main samples its next token), so the promise has no block
      continue
    if block and block[-1] == vocab.async_close and not any(t in vocab.scoped_tags for t in block):
      out += block
      promise_at = None
      continue
    # An open fork (or one not started yet): its settled text, up to an end id or a scoped-form tag, last token held
    block = block or []
    content = block[1:next((k for k, t in enumerate(block) if t in vocab.eos_ids or t in vocab.scoped_tags),
                           len(block)) - 1]
    return out + [vocab.async_open, *content, vocab.async_close] if content else out[:promise_at]
  if promise_at is not None:  # a promise whose LENGTH is not written yet: its fork's text will land there
    out = out[:promise_at]
  return out[:-1] if out and out[-1] not in vocab.tag_ids else out


def clean_promises(ids: Sequence[int], tokenizer, vocab: TagVocab) -> list[int]:
  """`ids` up to the first promise whose rendered tag would not read back as one: a topic holding a tag, or text
  with `"`, `<` or `>`. The lenient rendering of a malformed answer keeps such a promise as plain text, the other
  cleanings drop it, and only the end says which."""
  at = None
  for i, t in enumerate(ids):
    if t == vocab.promise and at is None:
      at = i
    elif at is not None and vocab.is_length(t):
      if any(x in vocab.tag_ids for x in ids[at + 1:i]) or any(c in '"<>' for c in tokenizer.decode(ids[at + 1:i])):
        return list(ids[:at])
      at = None
  return list(ids)


def text_runs(ids: Sequence[int], vocab: TagVocab) -> list[list[int]]:
  """The content ids of annotated `ids` in runs that the promise form decodes one by one: split at every tag and
  end id, topics (a promise up to its LENGTH) left out, as `result.content_ids` leaves them out."""
  runs, run, in_topic = [], [], False
  for t in ids:
    in_topic = (in_topic or t == vocab.promise) and not vocab.is_length(t)
    if in_topic or t in vocab.tag_ids or t in vocab.eos_ids:
      if run:
        runs.append(run)
      run = []
    else:
      run.append(t)
  return runs + [run] if run else runs


def common_prefix(a: str, b: str) -> str:
  n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return a[:n]


def before_tag_like(text: str) -> str:
  """`text` up to any plain text that reads as a tag or may still become one."""
  match = TAG_LIKE.search(text)
  if match:
    text = text[:match.start()]
  start = text.rfind("<")
  tail = TAG_START.match(text, start) if start >= 0 else None
  if tail and any(name.startswith(tail[1].lower()) for name in TAG_NAMES):
    text = text[:start]
  return text


def settled_text(records: np.ndarray, tokenizer, vocab: TagVocab, streams: bool) -> str:
  """The settled text: a prefix of the final `Result.text` of the run whose records so far are `records`, for any
  way it goes on ("" for a method that settles only at the end: `streams` False, its `Capabilities.stream`)."""
  if not streams:
    return ""
  runs = text_runs(clean_promises(settled_ids(records, vocab), tokenizer, vocab), vocab)
  while runs and "\ufffd" in tokenizer.decode(runs[-1][-1:]):  # a partial character: the next id decides it
    runs[-1].pop()
    if not runs[-1]:
      runs.pop()
  one_by_one = "".join(tokenizer.decode(run) for run in runs)
  together = tokenizer.decode([t for run in runs for t in run])
  return before_tag_like(common_prefix(one_by_one, together).rstrip("\ufffd"))


def delta(sent: str, text: str) -> str | None:
  """The new part of `text` after what was `sent`; None if `text` does not extend `sent` (the stream cannot take
  text back)."""
  if not text.startswith(sent):
    return None
  return text[len(sent):]
