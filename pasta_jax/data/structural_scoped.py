"""The earlier paper's structural annotator (`000_…` section 5.1), for the scoped form (lang/scoped.py).

"For responses with a list structure, we annotate the entire list with <scope>, and nested child of each
list item with <async>": a list (its items and their nested lists) becomes one `<scope>`; each item keeps
its marker and heading in the scope's thread (the synchronous content that holds the list together, the
paper's prompt asks for some in every scope) and its elaboration becomes a `<promise/><async>` block. The
heading is a bold span, the text up to a ':', or else the first clause; the elaboration is the rest of the
item with its continuation lines, and a nested list inside it becomes a nested `<scope>` (up to `max_depth`).
An elaboration shorter than `min_block` tokens stays in the thread as text: a fork costs tokens too.

Every character stays where it was: `lang.scoped.compose_text(annotate_scoped(a)) == a` byte for byte.
Answers without a block return None.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from pasta_jax.errors import TagError
from pasta_jax.lang import scoped
from pasta_jax.lang.scoped import ASYNC, ASYNC_END, PROMISE, SCOPE, SCOPE_END

ITEM = re.compile(r"^([ \t]*)(?:[-*+•]|\d{1,3}[.)])[ \t]+\S")
HEADING = re.compile(r"^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+(?:\*\*[^*\n]+\*\*:?|[^:\n]{2,60}:|[^.;!?\n]{2,80}[.;!?])")


@dataclasses.dataclass
class Item:
  indent: int
  lines: list[str]  # its own lines: the marker line, then continuation lines (blank lines included)
  children: list[Item] = dataclasses.field(default_factory=list)


def _lists(text: str) -> list[str | list[Item]]:
  """Text -> pieces covering it exactly: plain text (str) and lists (their top-level items, nested)."""
  pieces: list = []
  stack: list[Item] = []  # the open items, outermost first
  lines = text.splitlines(keepends=True)
  for k, line in enumerate(lines):
    match = ITEM.match(line)
    blank_inside = not line.strip() and stack and k + 1 < len(lines) and (
        ITEM.match(lines[k + 1]) or lines[k + 1].startswith((" ", "\t")))
    if match:
      item = Item(len(match.group(1).expandtabs(4)), [line])
      while stack and stack[-1].indent >= item.indent:
        stack.pop()
      if stack:
        stack[-1].children.append(item)
      else:
        if not pieces or isinstance(pieces[-1], str):
          pieces.append([])
        pieces[-1].append(item)
      stack.append(item)
    elif stack and (line.strip() or blank_inside):
      (stack[-1].children[-1] if stack[-1].children and not line.strip() else stack[-1]).lines.append(line)
    else:
      stack = []
      if pieces and isinstance(pieces[-1], str):
        pieces[-1] += line
      else:
        pieces.append(line)
  return pieces


def _item_text(item: Item) -> str:
  return "".join(item.lines) + "".join(_item_text(c) for c in item.children)


def _render_list(items: list[Item], depth: int, args) -> tuple[str, int]:
  """(scoped text of a list, blocks made); a list past the depth limit stays plain text."""
  if depth > args.max_depth:
    return "".join(_item_text(i) for i in items), 0
  out, blocks = [SCOPE], 0
  for item in items:
    text, made = _render_item(item, depth, args)
    out.append(text)
    blocks += made
  if not blocks:
    return "".join(_item_text(i) for i in items), 0
  body = "".join(out)
  trailing = body[len(body.rstrip("\n")):]  # the list's last newline(s) stay after the scope
  return body.rstrip("\n") + SCOPE_END + trailing, blocks


def _render_item(item: Item, depth: int, args) -> tuple[str, int]:
  first = item.lines[0]
  heading = HEADING.match(first)
  cut = heading.end() if heading else len(first.rstrip("\n"))
  own_rest = first[cut:] + "".join(item.lines[1:])
  nested, blocks = "", 0
  if item.children:
    nested, blocks = _render_list(item.children, depth + 1, args)
  elaboration = own_rest + nested
  plain = own_rest + "".join(_item_text(c) for c in item.children)
  if args.count_tokens(plain.strip()) < args.min_block or (not heading and not item.children):
    return first[:cut] + plain, 0
  inner = elaboration.rstrip("\n")
  trailing = elaboration[len(inner):]  # the item's newline stays in the scope's thread
  return first[:cut] + PROMISE + ASYNC + inner + ASYNC_END + trailing, blocks + 1


@dataclasses.dataclass(frozen=True)
class _Args:
  count_tokens: Callable[[str], int]
  min_block: int
  max_depth: int


def annotate_scoped(answer: str, count_tokens: Callable[[str], int], min_block: int = 4,
                    max_depth: int = scoped.DEFAULT_MAX_DEPTH) -> str | None:
  """The scoped annotation of `answer` (see the module doc), or None if it gets no block."""
  args = _Args(count_tokens, min_block, max_depth)
  out, blocks = [], 0
  for piece in _lists(answer):
    if isinstance(piece, str):
      out.append(piece)
    else:
      text, made = _render_list(piece, 1, args)
      out.append(text)
      blocks += made
  if not blocks:
    return None
  annotated = "".join(out)
  try:
    scoped.validate(annotated, max_depth)
  except TagError:  # the answer's own text spells a tag: no honest annotation
    return None
  return annotated if scoped.compose_text(annotated) == answer else None
