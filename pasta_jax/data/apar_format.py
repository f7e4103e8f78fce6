"""APAR-format data by the APAR paper's rules (Appendix B), in APAR's text form (decode/apar_text.py):
`root<fork/><child>detail</child>next root…`.

1. Ordered list: numbered items `N. title: details` (the details may run over continuation lines).
   Valid with at least 3 such items, each with at least 10 characters of content. Root = the item
   through its colon, detail = the rest of the item; text before and after the list stays in main.
2. Else paragraphs (split on blank lines): a paragraph of at least 2 sentences forks after its first
   sentence (root), the rest is the detail; one-sentence paragraphs stay in main.
3. Answers with code blocks, math, URLs or tables, or matching neither rule, are unstructured:
   APAR trains them as single nodes with no fork (negative examples).
Invariant: removing the tags gives the answer back byte for byte.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal

from pasta_jax.data.structural import split_items
from pasta_jax.decode.apar_text import CHILD_CLOSE, CHILD_OPEN, FORK_TAG

Kind = Literal["ordered_list", "paragraph", "unstructured"]
NUMBERED = re.compile(r"^(\s*\d+\.\s+)([^\n:]+?:)(.*)$", re.S)
AMBIGUOUS = re.compile(r"```|https?://|www\.|\$[^$\n]+\$|\\frac|\\sum|^\s*\|.*\|\s*$", re.M)
SENTENCE_END = re.compile(r"[.!?][\"')\]]*(\s+)(?=[A-Z0-9\"'(])")
MIN_ITEMS, MIN_CONTENT = 3, 10


@dataclasses.dataclass(frozen=True)
class AparResult:
  annotated: str | None  # APAR text form, None when unstructured
  kind: Kind
  reason: str


def fork(root: str, detail: str) -> str:
  return f"{root}{FORK_TAG}{CHILD_OPEN}{detail}{CHILD_CLOSE}"


def strip_apar(text: str) -> str:
  return text.replace(FORK_TAG, "").replace(CHILD_OPEN, "").replace(CHILD_CLOSE, "")


def ordered_list(answer: str) -> str | None:
  pieces = split_items(answer)
  items = [(i, NUMBERED.match(chunk)) for i, (kind, chunk) in enumerate(pieces) if kind == "item"]
  matched = [(i, m) for i, m in items if m is not None]
  if len(matched) < MIN_ITEMS or any(len(m.group(2) + m.group(3)) < MIN_CONTENT for _, m in matched):
    return None
  forks = {i: m for i, m in matched if m.group(3).strip()}
  out = []
  for i, (_, chunk) in enumerate(pieces):
    m = forks.get(i)
    out.append(fork(m.group(1) + m.group(2), m.group(3)) if m else chunk)
  return "".join(out)


def paragraphs(answer: str) -> str | None:
  out, forked = [], False
  for part in re.split(r"(\n\s*\n)", answer):
    end = SENTENCE_END.search(part)
    if part.strip() and end and part[end.end():].strip():
      out.append(fork(part[:end.end()], part[end.end():]))
      forked = True
    else:
      out.append(part)
  return "".join(out) if forked else None


def apar_annotate(answer: str) -> AparResult:
  if not answer.strip():
    return AparResult(None, "unstructured", "empty answer")
  if any(tag in answer for tag in (FORK_TAG, CHILD_OPEN, CHILD_CLOSE)):
    return AparResult(None, "unstructured", "the text spells an APAR tag")
  if AMBIGUOUS.search(answer):
    return AparResult(None, "unstructured", "code, math, URL or table")
  for kind, rule in (("ordered_list", ordered_list), ("paragraph", paragraphs)):
    annotated = rule(answer)
    if annotated is not None:
      if strip_apar(annotated) != answer:  # never alter content
        return AparResult(None, "unstructured", f"{kind} extraction would alter the text")
      return AparResult(annotated, kind, "")
  return AparResult(None, "unstructured", "no ordered list of >= 3 items and no multi-sentence paragraph")


def apar_records(records: Iterable[Mapping[str, str]]) -> tuple[list[dict], Counter]:
  """Rows with an `apar` field (None for negative examples) and the count per kind."""
  rows, kinds = [], Counter()
  for record in records:
    result = apar_annotate(str(record.get("output") or ""))
    kinds[result.kind] += 1
    rows.append({**record, "apar": result.annotated, "apar_kind": result.kind, "apar_reason": result.reason})
  return rows, kinds
