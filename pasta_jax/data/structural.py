"""A small structural annotator: markdown list items become PASTA blocks.

Honest and mechanical (no model): it only uses the answer's layout.
  - every list item (`- x`, `* x`, `+ x`, `• x`, `1. x`, `1) x`, with its continuation lines)
    becomes `1. <promise topic="its heading" tokens="round_length(true count)"/><async>x</async>`: the
    marker stays in main, so main numbers the items and a fork never has to count promises;
    the topic is the item's heading (text before a ':' or a bold span) or else its first clause, up to
    6 words: a fork sees only its topic, so the topic must say what the block holds, or sibling forks
    write the same thing (the duplicate blocks of the first trained model, cut by this);
  - lead text before the first item stays in main; without lead text the first item stays in main
    (main has something to say before its first promise);
  - with `min_saving` > 0, an item forks only if its block saves main at least that many tokens: its body
    minus what main writes to promise it (topic + PROMISE_COST tokens). Short items (a name, a few words)
    stay in main as plain text, so a model trained on the result forks long items and writes lists of
    short ones in sequence, where a fork only costs (`--min-saving` of train.recipe);
  - a `<sync/>` goes before a final paragraph that follows the last item, if there is one;
  - every character stays where it was, so `strip_tags(annotate(a)) == a` byte for byte.
Answers with no block return None.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pasta_jax.errors import TagError
from pasta_jax.lang import text as T
from pasta_jax.lang.tags import round_length

ITEM = re.compile(r"^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+\S")
MARKER = re.compile(r"^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+")
WORD = re.compile(r"[A-Za-z0-9][\w'’-]*")
# What a fork costs besides its topic: main writes <promise> and the length token, and the fork's own
# inserted <async> lies on the critical path too (an estimate: the end-of-block tokens are not counted)
PROMISE_COST = 3


def split_items(text: str) -> list[tuple[str, str]]:
  """Text -> pieces ('text' | 'item', chunk) covering it exactly, lines kept whole with their '\\n'.

  A list item runs from its marker line through following non-blank, non-item lines; a blank line
  or a new marker ends it (the blank line goes to main).
  """
  pieces: list[tuple[str, str]] = []
  in_item = False
  for line in text.splitlines(keepends=True):
    if ITEM.match(line):
      pieces.append(("item", line))
      in_item = True
    elif in_item and line.strip():
      pieces[-1] = ("item", pieces[-1][1] + line)
    else:
      in_item = False
      if pieces and pieces[-1][0] == "text":
        pieces[-1] = ("text", pieces[-1][1] + line)
      else:
        pieces.append(("text", line))
  return pieces


HEADING = re.compile(r"^\s*\*\*(.+?)\*\*|^([^:\n]{2,60}):")
CLAUSE_END = re.compile(r"[.;!?\n(]| - | – | — ")


def topic_of(item: str, max_words: int = 6) -> str:
  """The item's heading (before ':' or in bold), else its first clause: at most `max_words` words, marker
  dropped, safe as a promise topic."""
  body = MARKER.sub("", item, count=1)
  heading = HEADING.match(body)
  if heading:
    body = heading.group(1) or heading.group(2)
  else:
    body = CLAUSE_END.split(body, maxsplit=1)[0]
  words = WORD.findall(body)[:max_words] or WORD.findall(MARKER.sub("", item, count=1))[:max_words]
  return " ".join(words) if words else "item"


def block_saving(item: str, count_tokens: Callable[[str], int]) -> int:
  """Tokens a fork of this item saves main: its body minus the promise that replaces it."""
  body = item[MARKER.match(item).end():]
  return count_tokens(body) - count_tokens(topic_of(item)) - PROMISE_COST


def annotate(answer: str, count_tokens: Callable[[str], int], min_saving: int = 0) -> str | None:
  """The promise-form annotation of `answer` (see module doc), or None if it gets no block."""
  pieces = split_items(answer)
  first_item = next((i for i, (kind, _) in enumerate(pieces) if kind == "item"), None)
  if first_item is None:
    return None
  keep_first = not any(chunk.strip() for _, chunk in pieces[:first_item])
  last_item = max(i for i, (kind, _) in enumerate(pieces) if kind == "item")
  segments: list[T.Segment] = []
  for i, (kind, chunk) in enumerate(pieces):
    earns_block = kind == "item" and (min_saving <= 0 or block_saving(chunk, count_tokens) >= min_saving)
    if not earns_block or (keep_first and i == first_item):
      if i > last_item and chunk.strip() and any(isinstance(s, T.Block) for s in segments):
        segments.append(T.Sync())  # the final paragraph sums up: it waits for the blocks
      segments.append(T.Text(chunk))
      continue
    marker = MARKER.match(chunk).end()  # the list marker stays in main: main numbers the items, forks
    body = chunk[marker:]  # never have to count their siblings' promises to know their own number
    segments += [T.Text(chunk[:marker]), T.Promise(topic_of(chunk), round_length(count_tokens(body))),
                 T.Block((T.Text(body),))]
  if not any(isinstance(s, T.Block) for s in segments):
    return None
  try:
    return T.render(T.normalize(segments))
  except TagError:  # the answer's own text spells a tag: no honest annotation
    return None
