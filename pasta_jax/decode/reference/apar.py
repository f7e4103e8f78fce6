"""The reference interpreter's APAR mode: the oracle for `decode/rules/apar.py`, with explicit visible sets.

APAR (the APAR paper, Algorithm 1) one request and one token at a time:
- Any running lane whose pending token is APAR_FORK forks when it feeds it: the k-th forking lane
  (lane order) takes the k-th free lane and the next thread id; a forking lane with no free lane or
  thread id left does not feed this step (a stall). The child's inserted APAR_CHILD is pending at
  the fork's position + 1 and feeds in the same step; the parent's next token also takes p + 1.
- All feeders write first (each the lowest free slot, in lane order), then attend. A child's set
  is a copy of its parent's (which holds the fork written this step) plus its own writes. Nobody
  ever gains a view of a child: there is no sync.
- An end id finishes its thread at once (recorded, never fed). The request finishes when no lane
  runs. After each step every slot no running thread sees is released, and later writes reuse it.
- Constraints: no PASTA tag and no APAR_CHILD ever; no APAR_FORK right after APAR_FORK or
  APAR_CHILD, nor in a thread at the depth limit (main = depth 0), nor while no fork lane is free
  (as the lanes stand before this step's samples), so sampled runs never deadlock. A step where
  every running lane waits on a fork (forced scripts only) stops the request as truncated. Forced tokens bypass them; an
  exhausted script gives an end id in every thread.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pasta_jax.decode.reference.pasta import (
  DONE,
  FREE,
  RUNNING,
  Lane,
  ReferenceResult,
  Request,
  constrain_logits,
  draw,
  penalized_row,
)
from pasta_jax.decode.sampling import lane_key
from pasta_jax.lang.tags import TagVocab


def apar_constraint_mask(vocab: TagVocab, vocab_size: int, may_fork: bool) -> np.ndarray:
  allowed = np.ones((vocab_size,), bool)
  banned = {vocab.promise, vocab.async_open, vocab.async_close, vocab.sync, vocab.apar_child, *vocab.lengths,
            *vocab.scoped_tags}
  if not may_fork:
    banned.add(vocab.apar_fork)
  allowed[[t for t in banned if 0 <= t < vocab_size]] = False
  return allowed


@dataclasses.dataclass(frozen=True, eq=False)
class AparReferenceResult(ReferenceResult):
  peak_live: int = 0  # (its `refusals`: rows at a limit whose most likely grammatical token was [Fork])
  parents: dict[int, int] = dataclasses.field(default_factory=dict)  # thread -> parent thread
  slot_table: dict[int, tuple[int, int, int, bool]] = dataclasses.field(default_factory=dict)
  # slot -> (owner, write order, position, valid) as the pool holds it at the end

  def annotated_tokens(self) -> list[int]:
    """Tree order (APAR's RESTORE): each child's tokens spliced right after its parent's fork."""
    children: dict[int, list[int]] = {}
    for thread, parent in sorted(self.parents.items()):
      children.setdefault(parent, []).append(thread)

    def walk(thread: int) -> list[int]:
      out, kids = [], iter(children.get(thread, []))
      for token in self.thread_tokens(thread):
        out.append(token)
        if token == self.vocab.apar_fork:
          kid = next(kids, None)
          if kid is not None:
            out.extend(walk(kid))
      return out

    return walk(0)


class AparRequest(Request):
  """One request in APAR mode (module doc)."""

  def __init__(self, cfg, index, prompt, script):
    self.depth, self.parents = {0: 0}, {}
    self.order: dict[int, int] = {}  # slot -> write order
    self.live: set[int] = set()
    self.fed_token: int | None = None  # the token the choosing lane just fed (None at prefill)
    self.has_free = cfg.lanes > cfg.initial_threads  # a fork lane is free: sampling may fork
    super().__init__(cfg, index, prompt, script)
    self.order = {i: i for i in range(len(prompt))}
    self.live = set(range(len(prompt)))
    self.next_order = len(prompt)
    self.peak_live = len(prompt)
    self.refusals = 0
    self._fan_out(len(prompt))

  def _fan_out(self, prompt_len: int) -> None:
    """Threads 1..k-1 start beside main: each sees the prompt, its script's first token pending."""
    for thread in range(1, self.cfg.initial_threads):
      lane = self.lanes[thread]
      lane.state, lane.thread, lane.position = RUNNING, thread, prompt_len
      lane.token = int(self.script[thread][0])
      self.cursor[thread] = 1
      self.seen[thread] = set(range(prompt_len))
      self.depth[thread], self.parents[thread] = 1, 0
      self._record(0, thread, thread, lane.token, prompt_len, None)
    self.next_thread = self.cfg.initial_threads

  def step(self, step: int) -> None:
    feeders, spawns, stalls = self._plan()
    if self.cfg.pool_slots - len(self.live) < len(feeders) or not feeders:
      # All or nothing, as in PASTA mode. No feeder while a lane runs: every running lane waits on a
      # fork no lane can take (a deadlock only forced scripts can make): stop.
      self.truncated = True
      return
    self.stalls += stalls
    children = [self._spawn_child(step, parent, target) for parent, target in spawns]
    slots = self._write(feeders, children)
    if feeders:
      self.last_fed = step
    self.has_free = any(lane.state == FREE for lane in self.lanes[1:])  # as the lanes stood before sampling
    for lane in feeders:
      self._next(step, lane, slots[lane])
    self._release()
    self.finished = not any(lane.state == RUNNING for lane in self.lanes)

  def _plan(self) -> tuple[list[int], list[tuple[int, int]], int]:
    """(feeding lanes in lane order, (parent lane, target lane) spawns, stalled forks)."""
    running = [i for i, lane in enumerate(self.lanes) if lane.state == RUNNING]
    forking = [i for i in running if self.lanes[i].token == self.vocab.apar_fork]
    free = [i for i in range(1, len(self.lanes)) if self.lanes[i].state == FREE]
    can = max(0, min(len(forking), len(free), self.cfg.max_threads - self.next_thread))
    spawns = list(zip(forking[:can], free[:can], strict=True))
    stalled = set(forking[can:])
    feeders = sorted([i for i in running if i not in stalled] + [target for _, target in spawns])
    return feeders, spawns, len(stalled)

  def _spawn_child(self, step: int, parent_lane: int, target: int) -> tuple[int, int]:
    thread = self.next_thread
    self.next_thread += 1
    parent = self.lanes[parent_lane]
    lane = self.lanes[target]
    lane.state, lane.thread = RUNNING, thread
    lane.token, lane.position = self.vocab.apar_child, parent.position + 1
    self.depth[thread] = self.depth[parent.thread] + 1
    self.parents[thread] = parent.thread
    self._record(step, target, thread, lane.token, lane.position, None)
    return thread, parent.thread

  def _write(self, feeders: list[int], children: list[tuple[int, int]]) -> dict[int, int]:
    slots = {}
    for index in feeders:
      lane = self.lanes[index]
      slot = min(set(range(self.cfg.pool_slots)) - self.live)
      token = (lane.token, lane.thread, lane.position)
      if slot < len(self.entries):
        self.entries[slot], self.visible[slot] = token, frozenset()
      else:
        self.entries.append(token)
        self.visible.append(frozenset())
      self.order[slot] = self.next_order
      self.next_order += 1
      self.live.add(slot)
      slots[index] = slot
      self.seen.setdefault(lane.thread, set()).add(slot)
    for child, parent in children:  # after every write: the parent's set holds its fork
      self.seen[child] = set(self.seen[parent]) | self.seen[child]
    for index, slot in slots.items():
      self.visible[slot] = frozenset(self.seen[self.lanes[index].thread])
    self.peak_live = max(self.peak_live, len(self.live))
    return slots

  def _next(self, step: int, index: int, slot: int) -> None:
    lane = self.lanes[index]
    row = self._model_row(slot)
    self.fed_token = lane.token
    token = self._choose(row, step, index, lane.thread, slot)
    position = lane.position + 1
    self._record(step, index, lane.thread, token, position, row)
    if token in self.vocab.eos_ids:
      if index == 0:
        lane.state = DONE
      else:
        self.lanes[index] = Lane()
      return
    lane.token, lane.position = token, position

  def _release(self) -> None:
    needed = set()
    for lane in self.lanes:
      if lane.state == RUNNING:
        needed |= self.seen[lane.thread]
    self.live &= needed

  def _choose(self, row: np.ndarray, step: int, lane: int, thread: int, slot: int) -> int:
    scripted = self.script is not None and (
        not self.cfg.sample_after_script or self.cursor.get(thread, 0) < len(self._script_of(thread)))
    if scripted:
      return self._forced(thread)
    row = penalized_row(row, self.entries, self.visible[slot], self.cfg.sampling, self.vocab)
    fed = self.fed_token
    grammar_may_fork = fed not in (self.vocab.apar_fork, self.vocab.apar_child)
    under_limits = self.depth[thread] < self.cfg.max_depth and self.has_free
    if grammar_may_fork and not under_limits:  # a refused fork is counted, not silent
      top = int(np.argmax(constrain_logits(row, apar_constraint_mask(self.vocab, row.shape[-1], True))))
      self.refusals += top == self.vocab.apar_fork
    allowed = apar_constraint_mask(self.vocab, row.shape[-1], grammar_may_fork and under_limits)
    key = lane_key(jax.random.key(self.cfg.sampling.seed), self.index, step, lane)
    token, self._draw = draw(constrain_logits(row, allowed), key, self.cfg.sampling)
    return token

  def _script_of(self, thread: int) -> list[int]:
    return self.script[thread] if thread < len(self.script) else []

  def _forced(self, thread: int) -> int:
    seq = self._script_of(thread)
    i = self.cursor.get(thread, 0)
    self.cursor[thread] = i + 1
    return int(seq[i]) if i < len(seq) else self.vocab.eos_ids[0]

  def result(self) -> AparReferenceResult:
    base = super().result()
    table = {slot: (owner, self.order[slot], position, slot in self.live)
             for slot, (_, owner, position) in enumerate(self.entries)}
    return AparReferenceResult(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ReferenceResult)},
                               peak_live=self.peak_live, parents=dict(self.parents),
                               slot_table=table)
