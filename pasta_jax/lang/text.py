"""PASTA-LANG text form: parse, validate, render, strip, and convert from the annotator's form.

Promise form (the user-facing format, DESIGN section 2):

  ... <promise topic="length formula" tokens="40"/><async>content</async> ... <sync/> ...

Exact tag grammar. Only these four byte strings are tags; every other character is text, so HTML
(`<p>`), code mentioning "<promise", `<promise>` or `<sync />` (with a space) never fork:

  PROMISE  = '<promise topic="' TOPIC '" tokens="' VALUE '"/>'
  ASYNC    = '<async>'
  ASYNC_END= '</async>'
  SYNC     = '<sync/>'
  TOPIC, VALUE = any characters except '"', '<' and '>' (no entity escapes)

A PROMISE whose VALUE is not a canonical decimal multiple of 10 in [10, 500] is an error (bad
`tokens`), not text: the shape says it was meant as a tag.

Structure: answer = (TEXT | SYNC | PROMISE ASYNC TEXT? ASYNC_END)*. The `<async>` must follow its
promise's `/>` directly, with not even whitespace between: in tokens the promise's LENGTH token is
followed by the fork's `<async>`, so characters between them would have no place to live and the
text -> tokens -> text round trip could not be exact. Inside a block only text is allowed (no
nesting in the default mode).

Whitespace: tags own exactly their own characters and nothing else. Every character outside a
tag, whitespace and newlines included, belongs to the neighbouring text segment unchanged. Hence
`strip_tags` (remove tags, splice each block in place of its promise) gives back the unannotated
answer byte for byte, and `strip_tags(from_annotator_form(a, n)) == strip_annotator_tags(a)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence

from pasta_jax.errors import TagError
from pasta_jax.lang.tags import LENGTH_STEP, MAX_LENGTH, round_length

_TOPIC = r'[^"<>]*'
TAG_PATTERN = re.compile(
    r'(?P<promise><promise topic="(?P<topic>' + _TOPIC + r')" tokens="(?P<tokens>' + _TOPIC + r')"/>)'
    r"|(?P<open><async>)|(?P<close></async>)|(?P<sync><sync/>)")
ASYNC, ASYNC_END, SYNC = "<async>", "</async>", "<sync/>"
# What looks like a tag but is not one (`<sync />`, `<promise topic='x' .../>`, `< async>`, ...): in the
# promise form these are plain text, so a model would learn them as words. `near_misses` finds them.
NEAR_MISS_PATTERN = re.compile(r"<\s*/?\s*(?:promise|async|sync)\b[^<>]*>", re.IGNORECASE)

# The annotator's form (the later paper, Appendix A): `<async topic='x'>...</async>` and `<sync/>`.
# LLM output, so a little lenient: either quote style, whitespace around `=` and before `>`, and
# `<sync />`. A bare `<async>` is recognized only to report it (an annotator block needs a topic).
ANNOTATOR_PATTERN = re.compile(
    r"""(?P<open><async\s+topic\s*=\s*(?:'(?P<t1>[^'<>]*)'|"(?P<t2>[^"<>]*)")\s*>)"""
    r"|(?P<bare><async>)|(?P<close></async>)|(?P<sync><sync\s*/>)")


@dataclasses.dataclass(frozen=True)
class Text:
  text: str


@dataclasses.dataclass(frozen=True)
class Promise:
  topic: str
  tokens: int


@dataclasses.dataclass(frozen=True)
class Block:
  content: tuple[Text, ...] = ()  # parse gives at most one Text (none for an empty block)

  @property
  def text(self) -> str:
    return "".join(t.text for t in self.content)


@dataclasses.dataclass(frozen=True)
class Sync:
  pass


Segment = Text | Promise | Block | Sync


# --- error places ----------------------------------------------------------------------------------
def where(text: str, offset: int) -> str:
  """'line L, col C (offset O) near '...'' for error messages; line and col count from 1."""
  line = text.count("\n", 0, offset) + 1
  col = offset - (text.rfind("\n", 0, offset) + 1) + 1
  excerpt = text[offset: offset + 40]
  ellipsis = "..." if len(text) > offset + 40 else ""
  return f"line {line}, col {col} (offset {offset}) near {excerpt!r}{ellipsis}"


def _error(text: str, offset: int, message: str) -> TagError:
  return TagError(f"{message} at {where(text, offset)}")


# --- parsing ---------------------------------------------------------------------------------------
def check_tokens_value(value: str, length_step: int = LENGTH_STEP) -> int:
  """The `tokens` attribute as an int; raises (without a place) unless canonical and in range. length_step: the
  granularity of the position mode the text was written in (`schema.length_step`: 1 for Pred-1x's exact lengths)."""
  if not re.fullmatch(r"0|[1-9][0-9]*", value):
    raise TagError(f'bad tokens="{value}": not a plain decimal number')
  number = int(value)
  if number % length_step or not length_step <= number <= MAX_LENGTH:
    raise TagError(f'bad tokens="{value}": must be a multiple of {length_step} in '
                   f"[{length_step}, {MAX_LENGTH}]")
  return number


def _scan(text: str) -> Iterable[tuple[int, int, str, re.Match | None]]:
  """(start, end, kind, match) for text runs ('text') and tags ('promise', 'open', 'close', 'sync')."""
  pos = 0
  for match in TAG_PATTERN.finditer(text):
    if match.start() > pos:
      yield pos, match.start(), "text", None
    kind = next(k for k in ("promise", "open", "close", "sync") if match[k] is not None)
    yield match.start(), match.end(), kind, match
    pos = match.end()
  if pos < len(text):
    yield pos, len(text), "text", None


def parse(text: str, length_step: int = LENGTH_STEP) -> list[Segment]:
  """Promise-form text -> segments; raises TagError naming the place of the first problem. length_step: the promise
  lengths' granularity (`check_tokens_value`).

  Main-thread text runs are maximal (never empty, never two in a row); a block holds at most one
  Text. `render(parse(text)) == text` for every text that parses.
  """
  segments: list[Segment] = []
  promise_at = None  # offset of a promise still waiting for its block
  block_at = None  # offset of the open `<async>`
  block_text: list[Text] = []
  for start, end, kind, match in _scan(text):
    if promise_at is not None and kind != "open":
      if kind == "text" and not text[start:end].strip():
        raise _error(text, start, "an <async> block must follow its promise directly (found only whitespace "
                     f"between them); the promise is at {where(text, promise_at)}; found")
      raise _error(text, promise_at, "promise without a block: the promise must be followed directly by "
                   "<async>...</async>; promise")
    if block_at is not None:
      if kind == "text":
        block_text.append(Text(text[start:end]))
      elif kind == "close":
        segments.append(Block(tuple(block_text)))
        block_at, block_text = None, []
      else:
        raise _error(text, start, f"nesting: {text[start:end]!r} inside the <async> block opened at "
                     f"{where(text, block_at)}; no tag but </async> may appear in a block; found")
      continue
    if kind == "text":
      segments.append(Text(text[start:end]))
    elif kind == "promise":
      try:
        tokens = check_tokens_value(match["tokens"], length_step)
      except TagError as e:
        raise _error(text, start, str(e)) from None
      segments.append(Promise(match["topic"], tokens))
      promise_at = start
    elif kind == "open":
      if promise_at is None:
        raise _error(text, start, "block without a promise: <async> must directly follow a "
                     '<promise topic="..." tokens="N"/>; found')
      promise_at, block_at = None, start
    elif kind == "close":
      raise _error(text, start, "stray </async> outside any block")
    else:
      segments.append(Sync())
  if promise_at is not None:
    raise _error(text, promise_at, "promise without a block (the text ends); promise")
  if block_at is not None:
    raise _error(text, block_at, "unclosed <async> block (no </async> before the end of the text); opened")
  return segments


def validate(text: str) -> None:
  """Raises TagError (naming the place) unless `text` is well-formed promise form."""
  parse(text)


# --- rendering -------------------------------------------------------------------------------------
def check_segments(segments: Sequence[Segment], length_step: int = LENGTH_STEP) -> None:
  """Structure of a segment list (as built by code, not parsed); errors name the segment index."""
  for i, seg in enumerate(segments):
    after_promise = i > 0 and isinstance(segments[i - 1], Promise)
    if isinstance(seg, Promise):
      try:
        check_tokens_value(str(seg.tokens), length_step)
      except TagError as e:
        raise TagError(f"segment {i}: {e}") from None
      if re.search(r'["<>]', seg.topic):
        raise TagError(f"segment {i}: promise topic {seg.topic!r} contains '\"', '<' or '>'")
      if i + 1 == len(segments) or not isinstance(segments[i + 1], Block):
        raise TagError(f"segment {i}: promise without a block right after it")
    elif isinstance(seg, Block):
      if not after_promise:
        raise TagError(f"segment {i}: block without a promise right before it")
      for part in seg.content:
        if not isinstance(part, Text):
          raise TagError(f"segment {i}: nesting: a block may hold only Text, not {type(part).__name__}")
        _check_plain(part.text, f"segment {i} (block)")
    elif isinstance(seg, Text):
      _check_plain(seg.text, f"segment {i}")
    elif not isinstance(seg, Sync):
      raise TagError(f"segment {i}: not a PASTA-LANG segment: {seg!r}")


def near_misses(text: str) -> list[str]:
  """Spans of promise-form `text` that look like PASTA-LANG tags but are plain text (not exact tags)."""
  return [m.group() for m in NEAR_MISS_PATTERN.finditer(text) if not TAG_PATTERN.fullmatch(m.group())]


def _check_plain(text: str, name: str) -> None:
  match = TAG_PATTERN.search(text)
  if match:
    raise TagError(f"{name}: text spells the tag {match.group()!r} at offset {match.start()}; it would not "
                   "read back as text")


def render_promise(topic: str, tokens: int) -> str:
  return f'<promise topic="{topic}" tokens="{tokens}"/>'


def render(segments: Sequence[Segment]) -> str:
  """Segments -> promise-form text (validated first)."""
  check_segments(segments)
  parts = []
  for seg in segments:
    if isinstance(seg, Text):
      parts.append(seg.text)
    elif isinstance(seg, Promise):
      parts.append(render_promise(seg.topic, seg.tokens))
    elif isinstance(seg, Block):
      parts.append(ASYNC + seg.text + ASYNC_END)
    else:
      parts.append(SYNC)
  return "".join(parts)


def normalize(segments: Sequence[Segment]) -> list[Segment]:
  """The form `parse` gives: empty texts dropped, neighbouring texts merged, block text joined."""
  out: list[Segment] = []
  for seg in segments:
    if isinstance(seg, Block):
      seg = Block((Text(seg.text),) if seg.text else ())
    if isinstance(seg, Text):
      if not seg.text:
        continue
      if out and isinstance(out[-1], Text):
        seg = Text(out.pop().text + seg.text)
    out.append(seg)
  return out


def strip_tags(answer: str | Sequence[Segment]) -> str:
  """The clean answer: tags and topics removed, each block's text in place of its promise."""
  segments = parse(answer) if isinstance(answer, str) else answer
  return "".join(s.text for s in segments if isinstance(s, (Text, Block)))


# --- the annotator's form --------------------------------------------------------------------------
def _scan_annotator(text: str) -> list[tuple[int, int, str, re.Match | None]]:
  out, pos = [], 0
  for match in ANNOTATOR_PATTERN.finditer(text):
    if match.start() > pos:
      out.append((pos, match.start(), "text", None))
    kind = next(k for k in ("open", "bare", "close", "sync") if match[k] is not None)
    out.append((match.start(), match.end(), kind, match))
    pos = match.end()
  if pos < len(text):
    out.append((pos, len(text), "text", None))
  return out


def clean_topic(topic: str) -> str:
  """An annotator topic as a promise topic: whitespace runs (line wraps) -> one space, '"' -> "'"."""
  return " ".join(topic.split()).replace('"', "'")


def parse_annotator_form(text: str) -> list[Segment]:
  """`<async topic='x'>...</async>` form -> segments (a Promise + Block per annotator block).

  The promises' `tokens` are 0 here (unknown); `from_annotator_form` fills them in.
  """
  segments: list[Segment] = []
  open_at, block = None, []  # offset of the open block, and its text
  for start, end, kind, match in _scan_annotator(text):
    piece = text[start:end]
    if kind == "text":
      tag = TAG_PATTERN.search(piece)
      if tag:
        raise _error(text, start + tag.start(), f"annotator text already holds the promise-form tag "
                     f"{tag.group()!r}; convert text that is entirely in one form")
      (block if open_at is not None else segments).append(Text(piece))
    elif kind == "bare":
      raise _error(text, start, "annotator block without a topic: write <async topic='...'>")
    elif kind == "close":
      if open_at is None:
        raise _error(text, start, "stray </async> outside any block")
      segments.append(Block(tuple(block)))
      open_at, block = None, []
    elif open_at is not None:  # an opening tag or <sync/> inside a block
      raise _error(text, start, f"nesting: {piece!r} inside the block opened at {where(text, open_at)}; "
                   "found")
    elif kind == "open":
      open_at = start
      segments.append(Promise(clean_topic(match["t1"] if match["t1"] is not None else match["t2"]), 0))
    else:
      segments.append(Sync())
  if open_at is not None:
    raise _error(text, open_at, "unclosed <async> block (no </async> before the end of the text); opened")
  return normalize(segments)


def strip_annotator_tags(text: str) -> str:
  """The annotator's text with its tags removed: the original response, byte for byte."""
  return strip_tags(parse_annotator_form(text))


def from_annotator_form(text: str, count_tokens: Callable[[str], int]) -> str:
  """`<async topic='x'>C</async>` -> `<promise topic="x" tokens="N"/><async>C</async>`.

  N = round_length(count_tokens(C)): the block's true token count (C exactly as written, leading
  and trailing whitespace included, as it is encoded), rounded to a multiple of 10 in [10, 500].
  Everything outside the tags is kept byte for byte.
  """
  segments = parse_annotator_form(text)
  filled = []
  for i, seg in enumerate(segments):
    if isinstance(seg, Promise):
      seg = Promise(seg.topic, round_length(count_tokens(segments[i + 1].text)))
    filled.append(seg)
  return render(filled)


def to_annotator_form(text: str | Sequence[Segment]) -> str:
  """Promise form -> the annotator's form (single-quoted topic, as in the paper; lengths dropped)."""
  segments = parse(text) if isinstance(text, str) else text
  parts = []
  for i, seg in enumerate(segments):
    for part in seg.content if isinstance(seg, Block) else [seg] if isinstance(seg, Text) else []:
      if match := ANNOTATOR_PATTERN.search(part.text):
        raise TagError(f"segment {i}: text spells the annotator tag {match.group()!r} (offset "
                       f"{match.start()} in the segment); it has no annotator form")
    if isinstance(seg, Text):
      parts.append(seg.text)
    elif isinstance(seg, Promise):
      quote = '"' if "'" in seg.topic else "'"
      parts.append(f"<async topic={quote}{seg.topic}{quote}>")
    elif isinstance(seg, Block):
      parts.append(seg.text + ASYNC_END)
    else:
      parts.append(SYNC)
  return "".join(parts)
