"""APAR's text form, `root<fork/><child>detail</child>next root…`, to and from tree-order ids.

Tokens: APAR_FORK, APAR_CHILD and an end id that closes a child. Any tokenizer with encode/decode works.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pasta_jax.errors import TagError
from pasta_jax.lang.tags import TagVocab

FORK_TAG, CHILD_OPEN, CHILD_CLOSE = "<fork/>", "<child>", "</child>"
_APAR_TAGS = re.compile(r"<fork/>|<child>|</child>")


def encode_apar_text(text: str, tokenizer, vocab: TagVocab, where: str = "",
                     end_id: int | None = None) -> list[int]:
  """APAR text form -> tree-order ids (children end with `end_id`, default the vocab's first end id;
  main's end id is not included)."""
  end = vocab.eos_ids[0] if end_id is None else end_id
  ids, depth, last = [], 0, 0
  pieces = list(_APAR_TAGS.finditer(text))
  for k, match in enumerate(pieces):
    if match.start() > last:
      ids += tokenizer.encode(text[last:match.start()])
    tag = match.group()
    if tag == FORK_TAG:
      nxt = pieces[k + 1] if k + 1 < len(pieces) else None
      if nxt is None or nxt.group() != CHILD_OPEN or nxt.start() != match.end():
        raise TagError(f"{where}character {match.start()}: <fork/> must be followed by <child>")
      ids.append(vocab.apar_fork)
    elif tag == CHILD_OPEN:
      if k == 0 or pieces[k - 1].group() != FORK_TAG or pieces[k - 1].end() != match.start():
        raise TagError(f"{where}character {match.start()}: <child> without <fork/> before it")
      ids.append(vocab.apar_child)
      depth += 1
    else:
      if depth == 0:
        raise TagError(f"{where}character {match.start()}: </child> without an open <child>")
      ids.append(end)
      depth -= 1
    last = match.end()
  if last < len(text):
    ids += tokenizer.encode(text[last:])
  if depth:
    raise TagError(f"{where}end of text: {depth} <child> block(s) never closed")
  return ids


def decode_tree(ids: Sequence[int], tokenizer, vocab: TagVocab) -> tuple[str, str]:
  """Tree-order ids -> (clean text, APAR text form); lenient about a cut-off end."""
  clean, annotated, chunk = [], [], []

  def flush():
    if chunk:
      piece = tokenizer.decode(chunk)
      clean.append(piece)
      annotated.append(piece)
      chunk.clear()

  depth = 0
  for t in ids:
    if t == vocab.apar_fork:
      flush()
      annotated.append(FORK_TAG)
    elif t == vocab.apar_child:
      flush()
      annotated.append(CHILD_OPEN)
      depth += 1
    elif t in vocab.eos_ids:
      flush()
      if depth:
        annotated.append(CHILD_CLOSE)
        depth -= 1
    elif t not in vocab.tag_ids:
      chunk.append(t)
  flush()
  return "".join(clean), "".join(annotated) + CHILD_CLOSE * depth
