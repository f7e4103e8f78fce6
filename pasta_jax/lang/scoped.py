"""The earlier paper's scoped PASTA-LANG (`000_…` sections 2-4): text and tokens, validation, composition.

  <scope> ... <promise/><async> block </async> ... </scope>

`<scope>` containers nest inside scopes and inside async blocks; `<promise/>` carries no attribute and is
always followed by its block (the interpreter writes `<async>`, never the model); every `<async>` has a
`<scope>` ancestor. The final answer replaces each `<promise/>` with its block's content: with the block
written right after its promise, that is the text with every tag removed (`compose`).

The same tree serves both forms: a leaf is a text run (a str, in the text form) or a run of token ids (a
tuple, in the token form). Errors name the place: line and column in text, the token index in ids.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence

from pasta_jax.errors import TagError
from pasta_jax.lang.tags import TagVocab
from pasta_jax.lang.text import where

SCOPE, SCOPE_END, PROMISE, ASYNC, ASYNC_END = "<scope>", "</scope>", "<promise/>", "<async>", "</async>"
TAG_PATTERN = re.compile("|".join(re.escape(t) for t in (SCOPE, SCOPE_END, PROMISE, ASYNC, ASYNC_END)))
DEFAULT_MAX_DEPTH = 3  # nesting limit of scopes, and of forks (the constraint masks' depth limit)


@dataclasses.dataclass(frozen=True)
class Scope:
  """A parallel scope: its `</scope>` waits for the forks started inside it (and theirs)."""

  body: tuple  # items: leaves, Scope, Fork


@dataclasses.dataclass(frozen=True)
class Fork:
  """A `<promise/>` with its `<async>` block: the block's items, decoded by a fork of the thread."""

  block: tuple


Item = str | tuple | Scope | Fork


# --- parsing: one builder for both forms -------------------------------------------------------------
@dataclasses.dataclass
class _Frame:
  kind: str  # "root", "scope", "async"
  opened_at: str
  items: list = dataclasses.field(default_factory=list)


class _Builder:
  """Events in order -> items; `place(i)` names event i's place in errors."""

  def __init__(self, place: Callable[[int], str], max_depth: int | None):
    self.place, self.max_depth = place, max_depth
    self.stack = [_Frame("root", "")]
    self.promise_at: int | None = None  # the event index of a promise waiting for its block

  def error(self, index: int, message: str) -> TagError:
    return TagError(f"{message} at {self.place(index)}")

  def depth(self, kind: str) -> int:
    return sum(f.kind == kind for f in self.stack)

  def add(self, index: int, kind: str, leaf=None) -> None:
    if self.promise_at is not None and kind != "async":
      raise self.error(self.promise_at, "a <promise/> with no <async> block right after it")
    if kind == "text":
      self.stack[-1].items.append(leaf)
    elif kind == "promise":
      self.promise_at = index
    elif kind in ("scope", "async"):
      self._open(index, kind)
    else:
      self._close(index, kind)

  def _open(self, index: int, kind: str) -> None:
    if kind == "async":
      if self.promise_at is None:
        raise self.error(index, "an <async> block with no <promise/> before it")
      if not self.depth("scope"):
        raise self.error(index, "an <async> block outside every <scope> (each must have a <scope> ancestor)")
      self.promise_at = None
    if self.max_depth is not None and self.depth(kind) >= self.max_depth:
      raise self.error(index, f"<{kind}> nested deeper than the limit of {self.max_depth}")
    self.stack.append(_Frame(kind, self.place(index)))

  def _close(self, index: int, kind: str) -> None:
    want = {"scope_end": "scope", "async_end": "async"}[kind]
    top = self.stack[-1]
    if top.kind != want:
      inside = "nothing" if top.kind == "root" else f"the <{top.kind}> opened at {top.opened_at}"
      raise self.error(index, f"</{want}> closes {inside}")
    self.stack.pop()
    node = Scope(tuple(top.items)) if want == "scope" else Fork(tuple(top.items))
    self.stack[-1].items.append(node)

  def finish(self, end: int) -> list:
    if self.promise_at is not None:
      raise self.error(self.promise_at, "a <promise/> with no <async> block right after it")
    if len(self.stack) > 1:
      top = self.stack[-1]
      raise TagError(f"the <{top.kind}> opened at {top.opened_at} is never closed (the answer ends at "
                     f"{self.place(end)})")
    return self.stack[0].items


_TEXT_KINDS = {SCOPE: "scope", SCOPE_END: "scope_end", PROMISE: "promise", ASYNC: "async", ASYNC_END: "async_end"}


def parse(text: str, max_depth: int | None = None) -> list[Item]:
  """Scoped text -> items; raises TagError naming the line and column of the first problem."""
  events = []
  pos = 0
  for match in TAG_PATTERN.finditer(text):
    if match.start() > pos:
      events.append((pos, "text", text[pos:match.start()]))
    events.append((match.start(), _TEXT_KINDS[match[0]], None))
    pos = match.end()
  if pos < len(text):
    events.append((pos, "text", text[pos:]))
  builder = _Builder(lambda i: where(text, events[i][0] if i < len(events) else len(text)), max_depth)
  for i, (_, kind, leaf) in enumerate(events):
    builder.add(i, kind, leaf)
  return builder.finish(len(events))


def _token_kinds(vocab: TagVocab) -> dict[int, str]:
  return {vocab.scope_open: "scope", vocab.scope_close: "scope_end", vocab.bare_promise: "promise",
          vocab.async_open: "async", vocab.async_close: "async_end"}


def parse_tokens(ids: Sequence[int], vocab: TagVocab, max_depth: int | None = None) -> list[Item]:
  """Scoped answer ids (no end id) -> items with tuple leaves; TagError names the token index. The later
  form's tags (PROMISE, LENGTH, SYNC) and end ids are refused inside the answer."""
  kinds = _token_kinds(vocab)
  foreign = (vocab.tag_ids - set(kinds)) | set(vocab.eos_ids)
  builder = _Builder(lambda i: f"token {i}" if i < len(ids) else f"the end (token {len(ids)})", max_depth)
  run: list[int] = []
  for i, token in enumerate(int(t) for t in ids):
    if token in foreign:
      raise builder.error(i, f"token id {token} is not part of the scoped form (a later-form tag or an end id)")
    if token not in kinds:
      run.append(token)
      continue
    if run:
      builder.add(i - len(run), "text", tuple(run))
      run = []
    builder.add(i, kinds[token])
  if run:
    builder.add(len(ids) - len(run), "text", tuple(run))
  return builder.finish(len(ids))


def validate(text: str, max_depth: int | None = None) -> None:
  parse(text, max_depth)


# --- rendering and composition -----------------------------------------------------------------------
def render(items: Iterable[Item]) -> str:
  """Items (text leaves) -> scoped text, the blocks written after their promises."""
  out = []
  for item in items:
    if isinstance(item, Scope):
      out += [SCOPE, render(item.body), SCOPE_END]
    elif isinstance(item, Fork):
      out += [PROMISE, ASYNC, render(item.block), ASYNC_END]
    else:
      out.append(item)
  return "".join(out)


def compose(items: Iterable[Item]) -> list:
  """The final answer's leaves in order: each promise replaced by its block's content, tags gone."""
  out: list = []
  for item in items:
    if isinstance(item, Scope):
      out += compose(item.body)
    elif isinstance(item, Fork):
      out += compose(item.block)
    else:
      out.append(item)
  return out


def compose_text(text: str) -> str:
  """Scoped text -> the final clean text (raises TagError on malformed text)."""
  return "".join(compose(parse(text)))


def compose_ids(ids: Sequence[int], vocab: TagVocab) -> list[int]:
  """Scoped answer ids -> the final answer's content ids, in order."""
  return [t for leaf in compose(parse_tokens(ids, vocab)) for t in leaf]


def encode(items: Iterable[Item], encode_text: Callable[[str], list[int]], vocab: TagVocab) -> list[int]:
  """Items with text leaves -> answer ids (no end id): each run encoded alone, tags as their ids."""
  ids: list[int] = []
  for item in items:
    if isinstance(item, Scope):
      ids += [vocab.scope_open, *encode(item.body, encode_text, vocab), vocab.scope_close]
    elif isinstance(item, Fork):
      ids += [vocab.bare_promise, vocab.async_open, *encode(item.block, encode_text, vocab), vocab.async_close]
    else:
      ids += encode_text(item)
  return ids


def decode(ids: Sequence[int], decode_text: Callable[[list[int]], str], vocab: TagVocab) -> str:
  """Answer ids -> scoped text, without validation (a truncated run renders as far as it went)."""
  names = {vocab.scope_open: SCOPE, vocab.scope_close: SCOPE_END, vocab.bare_promise: PROMISE,
           vocab.async_open: ASYNC, vocab.async_close: ASYNC_END}
  out, run = [], []
  for token in ids:
    if int(token) in names or int(token) in vocab.eos_ids:
      if run:
        out.append(decode_text(run))
        run = []
      out.append(names.get(int(token), ""))
    else:
      run.append(int(token))
  if run:
    out.append(decode_text(run))
  return "".join(out)


# --- threads -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ThreadScript:
  """One thread's own tokens (a fork's without the inserted `<async>`, ending with `</async>`; main's
  ending with an end id) and its children's scripts, in the order of its promises."""

  tokens: tuple[int, ...]
  children: tuple[ThreadScript, ...]

  def count(self) -> int:
    return 1 + sum(c.count() for c in self.children)


def thread_script(items: Iterable[Item], vocab: TagVocab, end: int) -> ThreadScript:
  """Token items -> the script tree a forced replay follows (`end`: main's end id, or `</async>`)."""
  tokens: list[int] = []
  children: list[ThreadScript] = []

  def walk(seq):
    for item in seq:
      if isinstance(item, Scope):
        tokens.append(vocab.scope_open)
        walk(item.body)
        tokens.append(vocab.scope_close)
      elif isinstance(item, Fork):
        tokens.append(vocab.bare_promise)
        children.append(thread_script(item.block, vocab, vocab.async_close))
      else:
        tokens.extend(int(t) for t in item)

  walk(items)
  return ThreadScript(tuple(tokens) + (end,), tuple(children))


def answer_script(answer_ids: Sequence[int], vocab: TagVocab, end: int | None = None) -> ThreadScript:
  """Annotated answer ids (an end id at the end is optional) -> main's script tree."""
  ids = [int(t) for t in answer_ids]
  if ids and ids[-1] in vocab.eos_ids:
    end, ids = ids[-1], ids[:-1]
  return thread_script(parse_tokens(ids, vocab), vocab, vocab.eos_ids[0] if end is None else end)


def descendants(roots: Iterable[int], children: dict[int, list[int]]) -> set[int]:
  """The threads `roots` and every thread they spawned, transitively (`children`: thread -> its spawns):
  what a `</scope>` syncs when `roots` are the threads its scope started."""
  out, todo = set(), list(roots)
  while todo:
    u = todo.pop()
    if u not in out:
      out.add(u)
      todo += children.get(u, [])
  return out


def scripts_by_thread(script: ThreadScript, vocab: TagVocab, lanes: int, max_threads: int) -> list[list[int]]:
  """Main's script tree -> each thread's own tokens, by thread id, as a forced replay numbers the threads.

  Thread ids are given at run time in spawn order, which depends on the schedule (a `<promise/>` waits for a
  free lane and a thread id, a `</scope>` for the forks of its scope), so this replays the scoped
  interpreter's scheduling rule on the tree (decode/reference/scoped.py, whose forced tokens need no model).
  A promise that never gets a thread id spawns no thread, and its script is left out."""
  return [list(s.tokens) for s in _SpawnOrder(script, vocab, lanes, max_threads).run()]


@dataclasses.dataclass
class _ReplayedThread:
  """One thread of a forced replay: its script, how far it has read it, and the threads it spawned."""

  script: ThreadScript
  read: int = 0
  children: list[int] = dataclasses.field(default_factory=list)
  scopes: list[list[int]] = dataclasses.field(default_factory=list)  # per open scope: the threads spawned in it

  def next_token(self, end: int) -> int:
    """Its script's next token; past its end, `end` (forced threads that ran out finish)."""
    self.read += 1
    return self.script.tokens[self.read - 1] if self.read <= len(self.script.tokens) else end

  def next_child(self) -> ThreadScript:
    """The script of the thread its next promise spawns (an empty one past its children)."""
    k = len(self.children)
    return self.script.children[k] if k < len(self.script.children) else ThreadScript((), ())


@dataclasses.dataclass
class _BusyLane:
  thread: int
  token: int  # what it feeds next
  closing: bool = False  # a fork's `</async>`: the lane is free once it has fed


class _SpawnOrder:
  """The scoped interpreter's schedule on a forced script tree, kept to what decides the thread ids: who
  feeds in a step, who spawns into which lane. Lane 0 is main's."""

  def __init__(self, script: ThreadScript, vocab: TagVocab, lanes: int, max_threads: int):
    self.vocab, self.max_threads = vocab, max_threads
    self.threads = [_ReplayedThread(script)]
    self.lanes: list[_BusyLane | None] = [None] * lanes
    self.lanes[0] = _BusyLane(0, self.threads[0].next_token(vocab.eos_ids[0]))

  def run(self) -> list[ThreadScript]:
    while self.step():
      pass
    return [thread.script for thread in self.threads]

  def step(self) -> bool:
    """One step; False once main is done (nothing spawns after that) or nothing can move."""
    feeders, wanting, main_done = self._who_feeds()
    free = [i for i, lane in enumerate(self.lanes) if i > 0 and lane is None]
    room = min(len(wanting), len(free), self.max_threads - len(self.threads))
    spawns = list(zip(wanting[:room], free[:room], strict=True))
    if main_done or not (feeders or spawns):
      return False
    for spawner, lane in spawns:
      self._spawn(spawner, lane)
    for index in sorted(feeders + [i for pair in spawns for i in pair]):
      self._feed(index)
    return True

  def _who_feeds(self) -> tuple[list[int], list[int], bool]:
    """(lanes that feed without spawning, lanes waiting to spawn, main done); changes nothing."""
    vocab, feeders, wanting = self.vocab, [], []
    for i, lane in enumerate(self.lanes):
      if lane is None:
        continue
      scopes = self.threads[lane.thread].scopes
      if lane.closing:
        feeders.append(i)
      elif lane.token == vocab.bare_promise:
        wanting.append(i)
      elif lane.token == vocab.scope_close and scopes:
        if not self._any_running(scopes[-1]):
          feeders.append(i)
      elif i == 0 and lane.token in vocab.eos_ids:
        if not any(fork is not None and not fork.closing for fork in self.lanes[1:]):
          return feeders, wanting, True  # the final sync: every fork has stopped
      else:
        feeders.append(i)
    return feeders, wanting, False

  def _any_running(self, roots: list[int]) -> bool:
    """Whether a thread of `roots`, or one they spawned, still runs (a closing fork no longer counts)."""
    subtree = descendants(roots, {u: t.children for u, t in enumerate(self.threads)})
    return any(lane is not None and not lane.closing and lane.thread in subtree for lane in self.lanes)

  def _spawn(self, spawner: int, lane: int) -> None:
    parent, child = self.threads[self.lanes[spawner].thread], len(self.threads)
    self.threads.append(_ReplayedThread(parent.next_child()))
    parent.children.append(child)
    for scope in parent.scopes:
      scope.append(child)
    self.lanes[lane] = _BusyLane(child, self.vocab.async_open)

  def _feed(self, index: int) -> None:
    """The lane feeds its token, then reads its next one; a fork's end id reads as `</async>`."""
    lane, vocab = self.lanes[index], self.vocab
    if lane.closing:
      self.lanes[index] = None
      return
    thread = self.threads[lane.thread]
    if lane.token == vocab.scope_open:
      thread.scopes.append([])
    elif lane.token == vocab.scope_close and thread.scopes:
      thread.scopes.pop()
    lane.token = thread.next_token(vocab.eos_ids[0] if lane.thread == 0 else vocab.async_close)
    if index > 0 and (lane.token == vocab.async_close or lane.token in vocab.eos_ids):
      lane.token, lane.closing = vocab.async_close, True


def depth(items: Iterable[Item]) -> tuple[int, int]:
  """(deepest scope nesting, deepest fork nesting) of the items."""
  scopes = forks = 0
  for item in items:
    if isinstance(item, Scope):
      s, f = depth(item.body)
      scopes, forks = max(scopes, s + 1), max(forks, f)
    elif isinstance(item, Fork):
      s, f = depth(item.block)
      scopes, forks = max(scopes, s), max(forks, f + 1)
  return scopes, forks


def critical_path(items: Iterable[Item], vocab: TagVocab) -> int:
  """Steps the interpreter needs with unlimited lanes (its `steps`: the last step anything feeds), for a
  well-formed answer (token items). Main feeds its answer from step 1 on; a child feeds its `<async>` in the
  step its promise feeds, then one token a step; a `</scope>` feeds no earlier than the step each block of
  its scope feeds its `</async>` (a closing fork no longer blocks). A tag-free answer of N tokens takes N."""
  step, last = _thread_steps(list(items), vocab, start=1, is_fork=False)
  return max(step - 1, last)


def _thread_steps(items: list, vocab: TagVocab, start: int, is_fork: bool) -> tuple[int, int]:
  """(the step after the thread's last feed, the last feed step of the thread and everything it spawned)."""
  step, last = start, start - 1
  scope_ends: list[int] = []  # per open scope: the latest `</async>` feed step of its blocks (and theirs)

  def walk(seq):
    nonlocal step, last
    for item in seq:
      if isinstance(item, Scope):
        step += 1  # `<scope>`
        scope_ends.append(0)
        walk(item.body)
        step = max(step, scope_ends.pop())  # `</scope>` waits for its blocks
        last = max(last, step)
        step += 1
      elif isinstance(item, Fork):
        child_end, child_last = _thread_steps(list(item.block), vocab, start=step + 1, is_fork=True)
        # The child's `<async>` feeds with the promise (step); its `</async>` feeds at child_end.
        for k in range(len(scope_ends)):
          scope_ends[k] = max(scope_ends[k], child_last)
        last = max(last, child_last, step)
        step += 1
      else:
        step += len(item)
        last = max(last, step - 1)

  walk(items)
  if is_fork:
    last = max(last, step)  # `</async>` feeds one step after the block's last content token
    return step + 1, last
  return step, last
