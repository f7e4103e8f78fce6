"""The pure-Python reference of the scoped mode (the earlier paper, docs/interpreter.md "Scoped mode").

One request, one token at a time, visibility as explicit Python sets of pool slots (no horizons), each
token's logits from one model call on exactly what it sees. The rules:

- Every thread (main or fork) may open `<scope>`s and write `<promise/>`s. A fed `<promise/>` forks a
  child at once: the child's set is a copy of the spawner's (its promise included), and the interpreter
  writes `<async>` as the child's first token in the same step. The spawner goes on without the child.
- A `</scope>` waits until every thread spawned inside that scope, and every descendant of theirs, has
  stopped running (a closing fork no longer blocks: within one step all feeders write first, then all
  attend). It then feeds, and it and everything after it see all those threads' tokens, as written.
- A fork ends at `</async>` (an end id in a fork counts as `</async>`). Main's end id waits for every
  running fork (the implicit final sync), then main is done.
- Position: a token's position is the size of its synchronous prefix, the set of tokens the query that
  chose it attended to (itself included). So a fork's `<async>` sits at |V(promise)|, the token after a
  `</scope>` at |V(`</scope>`)|, which counts the synced blocks.
- Spawners take free lanes in lane order (lowest spawner lane first, lowest free lane first) and the next
  thread ids; spawners left without a lane or a thread id stall (each counted) and retry next step.
- A step where nothing feeds and the request is not done is a deadlock (only a forced script can make
  one: sampling reserves lanes, below): the request stops, truncated, flagged `pool_full`.

Constraints (sampling only; forced tokens bypass them), for a lane that has just fed, given its thread's
open scopes (`open`), its scope depth (inherited + open) and fork depth:
  never `<async>` or the later form's tags; `<scope>` only below the scope depth limit; `</scope>` only
  with an open scope; `</async>` and end ids only with no open scope (and `</async>` only in a fork);
  `<promise/>` only below the fork depth limit, in main only inside a scope, and in a fork only while
  the free lanes outnumber the other lanes waiting with a pending `<promise/>`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pasta_jax.decode.reference.pasta import (
  CLOSING,
  DONE,
  FREE,
  RUNNING,
  Draw,
  Lane,
  PoolEntry,
  ReferenceResult,
  constrain_logits,
  draw,
  model_row,
  penalized_row,
)
from pasta_jax.decode.sampling import SamplingConfig, lane_key
from pasta_jax.lang.scoped import DEFAULT_MAX_DEPTH, ThreadScript, descendants
from pasta_jax.lang.tags import TagVocab


def scoped_constraint_mask(vocab: TagVocab, vocab_size: int, *, is_main: bool, open_scopes: int,
                           scope_depth: int, fork_depth: int, may_fork: bool, max_depth: int) -> np.ndarray:
  """[V] bool: the tokens a lane may sample in the scoped mode (the module docstring's list)."""
  allowed = np.ones((vocab_size,), bool)

  def ban(tokens):
    allowed[[t for t in tokens if 0 <= t < vocab_size]] = False

  ban(vocab.tag_ids - {vocab.scope_open, vocab.scope_close, vocab.bare_promise, vocab.async_close})
  if scope_depth >= max_depth:
    ban((vocab.scope_open,))
  if open_scopes == 0:
    ban((vocab.scope_close,))
  else:
    ban((vocab.async_close, *vocab.eos_ids))
  if is_main:
    ban((vocab.async_close,))
  if fork_depth >= max_depth or (is_main and open_scopes == 0) or not may_fork:
    ban((vocab.bare_promise,))
  return allowed


@dataclasses.dataclass
class Thread:
  parent: int
  fork_depth: int
  base_scope: int  # scope depth it was spawned at
  script: ThreadScript | None
  scopes: list[list[int]] = dataclasses.field(default_factory=list)  # per open scope: threads spawned in it
  children: list[int] = dataclasses.field(default_factory=list)
  cursor: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class ScopedResult(ReferenceResult):
  """A reference run, plus what the scoped mode adds: each thread's parent and the scripts by thread id."""

  pool_full: bool = False  # stopped because the pool had no room, or by a deadlock
  parents: list[int] = dataclasses.field(default_factory=list)
  scripts_by_thread: list[list[int]] = dataclasses.field(default_factory=list)


class ScopedRequest:
  """One request in the scoped mode (the module docstring)."""

  def __init__(self, model_fn, params, vocab: TagVocab, *, index: int, prompt: list[int], lanes: int,
               max_threads: int, pool_slots: int, sampling: SamplingConfig, max_depth: int,
               script: ThreadScript | None, bucket: bool = True, vocab_size: int | None = None):
    if not 0 < len(prompt) <= pool_slots:
      raise ValueError(f"request {index}: prompt of {len(prompt)} tokens does not fit {pool_slots} slots")
    self.model_fn, self.params, self.vocab = model_fn, params, vocab
    self.index, self.max_threads, self.pool_slots = index, max_threads, pool_slots
    self.sampling, self.max_depth, self.bucket, self.forced = sampling, max_depth, bucket, script is not None
    self.lanes = [Lane() for _ in range(lanes)]
    self.threads = [Thread(-1, 0, 0, script)]
    self.entries: list[tuple[int, int, int]] = []  # (token, thread, position) per slot
    self.visible: list[frozenset[int]] = []
    self.seen: dict[int, set[int]] = {0: set()}
    self.records: list[tuple[int, int, int, int, int]] = []
    self.logits: list[np.ndarray | None] = []
    self.draws: list[Draw | None] = []
    self._draw: Draw | None = None  # the last sampled choice, until it is recorded
    self.stalls, self.last_fed = 0, 0
    self.finished = self.truncated = self.pool_full = False
    for i, token in enumerate(prompt):
      self.entries.append((int(token), 0, i))
      self.visible.append(frozenset(range(i + 1)))
      self.seen[0].add(i)
    main = self.lanes[0]
    main.state, main.thread, main.position = RUNNING, 0, len(prompt)
    row = self._model_row(len(prompt) - 1)
    self.vocab_size = vocab_size or (None if row is None else row.shape[-1])
    main.token = self._choose(row, 0, 0, 0, len(prompt) - 1, may_fork=True)
    self._record(0, 0, 0, main.token, main.position, row)

  # -- one step ------------------------------------------------------------------------------------
  def step(self, step: int) -> None:
    feeders, spawners, done, stalled = self._who_feeds()
    if len(self.entries) + len(feeders) > self.pool_slots:
      self.truncated = self.pool_full = True  # all or nothing: no room for every feeder, nothing happens
      return
    if not feeders and not done:
      self.truncated = self.pool_full = True  # a deadlock: no thread can move
      return
    self.stalls += stalled
    if done:
      self.lanes[0].state = DONE
    for spawner, lane in spawners:
      self._spawn(step, lane, spawner)
    slots = self._write(feeders, dict((lane, spawner) for spawner, lane in spawners))
    if feeders:
      self.last_fed = step
    free_now = sum(lane.state == FREE for lane in self.lanes[1:])
    waiting = [i for i, lane in enumerate(self.lanes) if i not in slots and lane.state == RUNNING
               and lane.token == self.vocab.bare_promise]
    for index in feeders:
      self._next_token(step, index, slots[index], may_fork=free_now > len(waiting))
    self.finished = self.lanes[0].state == DONE and all(x.state == FREE for x in self.lanes[1:])

  def _subtree_running(self, scope: list[int]) -> bool:
    return any(self._thread_running(u) for u in self._subtree(scope))

  def _subtree(self, roots: list[int]) -> set[int]:
    return descendants(roots, {u: t.children for u, t in enumerate(self.threads)})

  def _thread_running(self, thread: int) -> bool:
    return any(lane.thread == thread and lane.state == RUNNING for lane in self.lanes)

  def _who_feeds(self):
    """(feeders in lane order, [(spawner lane, child lane)], main done, stalled spawners); changes nothing."""
    vocab = self.vocab
    feeds, spawners_wanting, done = [], [], False
    for i, lane in enumerate(self.lanes):
      if lane.state == CLOSING:
        feeds.append(i)
      if lane.state != RUNNING:
        continue
      thread = self.threads[lane.thread]
      if lane.token == vocab.bare_promise:
        spawners_wanting.append(i)
      elif lane.token == vocab.scope_close and thread.scopes:
        if not self._subtree_running(thread.scopes[-1]):
          feeds.append(i)
      elif i == 0 and lane.token in vocab.eos_ids:
        if any(x.state == RUNNING for x in self.lanes[1:]):
          pass  # the implicit final sync: wait for every running fork
        else:
          done = True
      else:
        feeds.append(i)
    free = [i for i, lane in enumerate(self.lanes) if i > 0 and lane.state == FREE]
    room = min(len(spawners_wanting), len(free), self.max_threads - len(self.threads))
    spawners = list(zip(spawners_wanting[:room], free[:room], strict=True))
    feeders = sorted(feeds + [s for s, _ in spawners] + [c for _, c in spawners])
    return feeders, spawners, done, len(spawners_wanting) - len(spawners)

  def _spawn(self, step: int, lane_index: int, spawner: int) -> int:
    parent_id = self.lanes[spawner].thread
    parent = self.threads[parent_id]
    thread = len(self.threads)
    script = None
    if parent.script is not None:
      k = len(parent.children)
      script = parent.script.children[k] if k < len(parent.script.children) else ThreadScript((), ())
    self.threads.append(Thread(parent_id, parent.fork_depth + 1, parent.base_scope + len(parent.scopes), script))
    parent.children.append(thread)
    for scope in parent.scopes:
      scope.append(thread)
    lane = self.lanes[lane_index]
    lane.state, lane.thread, lane.token, lane.position = RUNNING, thread, self.vocab.async_open, -1
    self._record(step, lane_index, thread, lane.token, -1, None)  # its position is fixed in `_write`
    return thread

  def _write(self, feeders: list[int], spawner_of: dict[int, int]) -> dict[int, int]:
    """Feeders take consecutive slots in lane order, then every visible set is fixed (writes before
    attention). Scope bookkeeping happens on the fed token; a child's `<async>` sits at |V(promise)|.
    spawner_of: each new child's lane -> its spawner's lane."""
    vocab, slots = self.vocab, {}
    for index in feeders:
      lane = self.lanes[index]
      slots[index] = len(self.entries)
      self.entries.append((lane.token, lane.thread, lane.position))
      self.visible.append(frozenset())
      self.seen.setdefault(lane.thread, set()).add(slots[index])
    for index in feeders:
      lane = self.lanes[index]
      thread = self.threads[lane.thread]
      if lane.state != RUNNING:
        continue
      if lane.token == vocab.scope_open:
        thread.scopes.append([])
      elif lane.token == vocab.scope_close and thread.scopes:
        synced = self._subtree(thread.scopes.pop())
        self.seen[lane.thread].update(k for k, (_, owner, _) in enumerate(self.entries) if owner in synced)
    for child_lane, spawner in spawner_of.items():
      child = self.lanes[child_lane].thread
      self.seen[child] |= self.seen[self.lanes[spawner].thread]
    for index, slot in slots.items():
      self.visible[slot] = frozenset(self.seen[self.lanes[index].thread])
    for child_lane, spawner in spawner_of.items():
      lane = self.lanes[child_lane]
      lane.position = len(self.visible[slots[spawner]])
      token, thread, _ = self.entries[slots[child_lane]]
      self.entries[slots[child_lane]] = (token, thread, lane.position)
      first = next(k for k, r in enumerate(self.records) if r[2] == thread)  # its inserted `<async>` record
      self.records[first] = self.records[first][:4] + (lane.position,)
    return slots

  def _next_token(self, step: int, index: int, slot: int, may_fork: bool) -> None:
    lane = self.lanes[index]
    if lane.state == CLOSING:
      self.lanes[index] = Lane()  # it just wrote </async>: its logits are never computed
      return
    row = self._model_row(slot)
    token = self._choose(row, step, index, lane.thread, slot, may_fork=index == 0 or may_fork)
    if index > 0 and (token == self.vocab.async_close or token in self.vocab.eos_ids):
      token, lane.state = self.vocab.async_close, CLOSING
    lane.token, lane.position = token, len(self.visible[slot])
    self._record(step, index, lane.thread, token, lane.position, row)

  # -- model, choice, records ----------------------------------------------------------------------
  def _model_row(self, slot: int) -> np.ndarray | None:
    if self.model_fn is None:
      return None  # a schedule-only run (forced scripts need no logits)
    return model_row(self.model_fn, self.params, self.entries, self.visible, slot, self.bucket)

  def _choose(self, row, step: int, lane: int, thread_id: int, slot: int, may_fork: bool) -> int:
    thread = self.threads[thread_id]
    if self.forced:
      tokens = thread.script.tokens
      thread.cursor += 1
      if thread.cursor <= len(tokens):
        return int(tokens[thread.cursor - 1])
      return self.vocab.eos_ids[0] if thread_id == 0 else self.vocab.async_close
    row = penalized_row(row, self.entries, self.visible[slot], self.sampling, self.vocab)
    allowed = scoped_constraint_mask(
        self.vocab, row.shape[-1], is_main=thread_id == 0, open_scopes=len(thread.scopes),
        scope_depth=thread.base_scope + len(thread.scopes), fork_depth=thread.fork_depth, may_fork=may_fork,
        max_depth=self.max_depth)
    key = lane_key(jax.random.key(self.sampling.seed), self.index, step, lane)
    token, self._draw = draw(constrain_logits(row, allowed), key, self.sampling)
    return token

  def _record(self, step, lane, thread, token, position, row) -> None:
    self.records.append((step, lane, thread, int(token), int(position)))
    self.logits.append(row)
    self.draws.append(self._draw)
    self._draw = None

  def result(self) -> ScopedResult:
    pool = [PoolEntry(t, u, p, v) for (t, u, p), v in zip(self.entries, self.visible, strict=True)]
    scripts = [list(t.script.tokens) if t.script is not None else [] for t in self.threads]
    return ScopedResult(records=list(self.records), logits=list(self.logits), draws=list(self.draws),
                        steps=self.last_fed, stalls=self.stalls, finished=self.finished, truncated=self.truncated,
                        pool=pool, vocab=self.vocab, pool_full=self.pool_full, parents=[t.parent for t in self.threads],
                        scripts_by_thread=scripts)


def run_scoped_reference(model_fn, params, prompts: list[list[int]], vocab: TagVocab, *, lanes: int,
                         max_threads: int, pool_slots: int, max_steps: int, sampling: SamplingConfig,
                         scripts: list[ThreadScript] | None = None, max_depth: int = DEFAULT_MAX_DEPTH,
                         bucket: bool = True) -> list[ScopedResult]:
  """Each request alone, steps 1 ... max_steps until finished or truncated. `scripts`: one script tree per
  request (forced replay); model_fn None runs the schedule only (forced, no logits)."""
  if scripts is not None and len(scripts) != len(prompts):
    raise ValueError(f"got {len(scripts)} scripts for {len(prompts)} prompts")
  if model_fn is None and scripts is None:
    raise ValueError("a run without a model needs scripts (a schedule-only forced run)")
  results = []
  for b, prompt in enumerate(prompts):
    request = ScopedRequest(model_fn, params, vocab, index=b, prompt=list(prompt), lanes=lanes,
                            max_threads=max_threads, pool_slots=pool_slots, sampling=sampling,
                            max_depth=max_depth, script=None if scripts is None else scripts[b], bucket=bucket)
    for step in range(1, max_steps + 1):
      request.step(step)
      if request.finished or request.truncated:
        break
    if not request.finished:
      request.truncated = True
    results.append(request.result())
  return results
