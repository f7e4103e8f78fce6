"""The slow, pure-Python reference interpreter: the test oracle for the jitted one.

It implements docs/interpreter.md one request at a time and one token at a time. There is no
horizon table and no `pasta_jax.visibility` here: visibility is kept as explicit Python sets of pool
slots, and each token's logits come from one model call on exactly the tokens it sees.

- Main's set grows with each main write. A fork's set at spawn is a copy of main's set (which
  already holds the `LENGTH` token written in that step), then grows with the fork's own writes. A
  `<sync/>` feed adds every fork token written so far to main's set, including the `</async>`
  tokens closing forks write in that same step: within a step all feeding lanes write first, then
  every feeder attends.
- Each written token remembers its visible set. A query's logits come from
  `model_fn(params, tokens[1, n], positions[1, n], mask[1, n, n], None, None, None).logits` over the
  query's visible tokens in write order, with `mask[i, j]` = token j is in token i's own set.

Choices where the contract leaves room (each is repeated where it is implemented):

- Records within one step: first the inserted `ASYNC` of a spawn (it becomes pending in the "who
  feeds" phase), then the sampled tokens in lane order (the "next tokens" phase).
- `logits[i]` belongs to `records[i]`: the raw model logits (before the constraint mask), float32
  [V]; `None` for an inserted `ASYNC`. A closing lane's logits are dropped and never computed.
- A step that fails the pool-room check changes nothing but `truncated` (as the contract says: no
  spawn, no stall counted, main not `done`), so no `ASYNC` is recorded either.
- The step budget counts steps 1 ... max_steps (step 0 is the sampling after prefill).
- `steps` is the last step in which some lane fed a token (0 if none did).
- "Inside a promise" is tracked over main's own sampled tokens only, starting outside: the prompt
  is plain text and never opens a promise, and no prompt token spawns a fork.
- Main inside a promise may sample "only topic text and LENGTH": every tag but `LENGTH` is banned
  there, which adds nothing to the listed bans now that `APAR_FORK` is banned everywhere.
- A topic's cap (`max_topic_tokens`) counts main's tokens after its last `PROMISE` in the pool; at the cap
  only a `LENGTH` is allowed, and a refusal counts where the argmax of the row (under the other constraints) is
  not one.
- Forced tokens bypass the constraints (they are not sampled), but follow every other rule: a
  forced `LENGTH` in main spawns, a forced end id in a fork is recorded as `ASYNC_END`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.constraints import fork_open_ids
from pasta_jax.decode.sampling import SamplingConfig, lane_key, near_tie, sample
from pasta_jax.lang import schema
from pasta_jax.lang.tags import TagVocab, reserved_span
from pasta_jax.lang.tokens import promise_topics, repeats_earlier_topic

Record = tuple[int, int, int, int, int]  # (step, lane, thread, token, position)
POSITION_MODES = schema.POSITION_MODES

# Lane states (docs/interpreter.md, State of one request).
FREE, RUNNING, CLOSING, DONE = "free", "running", "closing", "done"
# How far apart (each logit, nats) the reference's logits and the jitted loop's may be and still count as equal: they
# come from one model over the same tokens in another layout and order of sums (about 1e-6 apart on the toy model).
NEAR_TIE = 1e-4


# --- constraints ----------------------------------------------------------------------------------
def constraint_mask(vocab: TagVocab, vocab_size: int, is_main: bool, in_promise: bool) -> np.ndarray:
  """[V] bool, True where a token may be sampled (docs/interpreter.md, Constraints).

  - every thread: no `ASYNC`, `APAR_CHILD` (the interpreter inserts those), `APAR_FORK` or the scoped
    form's tags (PASTA mode);
  - main outside a promise: no `ASYNC_END`, no `LENGTH`;
  - main inside a promise: only topic text (non-tag tokens) and `LENGTH`;
  - a fork: no `PROMISE`, `LENGTH` or `SYNC`.
  `in_promise` is ignored for a fork.
  """
  allowed = np.ones((vocab_size,), bool)

  def ban(tokens):
    allowed[[t for t in tokens if 0 <= t < vocab_size]] = False

  ban((vocab.async_open, vocab.apar_child, vocab.apar_fork, *vocab.scoped_tags))
  if not is_main:
    ban((vocab.promise, vocab.sync, *vocab.lengths))
  elif in_promise:
    # "Only topic text and LENGTH": every tag but LENGTH, and the end ids, are out.
    ban(vocab.tag_ids - set(vocab.lengths))
    ban(vocab.eos_ids)
  else:
    ban((vocab.async_close, *vocab.lengths))
  return allowed


def penalized_row(row: np.ndarray, entries, visible_slots, sampling: SamplingConfig, vocab: TagVocab) -> np.ndarray:
  """The row under CTRL's repetition penalty over the tokens of the slots it sees (tags and end ids left out):
  seen logits > 0 are divided by the penalty, the others multiplied by it. Then the request's fork bias is added
  at the promise-open tokens (`constraints.bias_fork_open`: the constraint keeps it only where a promise may open)."""
  if sampling.penalizes:
    language = vocab.tag_ids | set(vocab.eos_ids)
    seen = np.zeros(row.shape[-1], bool)
    for k in visible_slots:
      token = entries[k][0]  # (token, thread, position)
      seen[token] = token not in language
    p = sampling.repetition_penalty
    row = np.where(seen, np.where(row > 0, row / p, row * p), row).astype(np.float32)
  if sampling.biases_forks:
    row = np.array(row, np.float32)
    row[[t for t in fork_open_ids(vocab) if t < row.shape[-1]]] += np.float32(sampling.fork_bias)
  return row


def constrain_logits(logits, allowed: np.ndarray) -> jax.Array:
  """-inf where a token is not allowed, so no sampler can pick it."""
  return jnp.where(jnp.asarray(allowed), jnp.asarray(logits, jnp.float32), -jnp.inf)


# --- position modes -------------------------------------------------------------------------------
def content_length(fork_script: Sequence[int], vocab: TagVocab) -> int:
  """True length of a scripted block: its tokens before the first `ASYNC_END` or end id.

  A script with neither ends where it runs out (the fork then takes `ASYNC_END`), so the length
  is the whole script.
  """
  for i, token in enumerate(fork_script):
    if token == vocab.async_close or token in vocab.eos_ids:
      return i
  return len(fork_script)


def span_for(mode: str, length_token: int, vocab: TagVocab, fork_script: Sequence[int] | None) -> int:
  """R, the positions main skips after a `LENGTH` token (docs/interpreter.md, Position modes)."""
  if mode in schema.ORACLE_MODES and fork_script is None:
    raise ValueError(f"position_mode={mode!r} needs a script (forced replay only)")
  return reserved_span(schema.block_length(mode, lambda: vocab.length_of(length_token),
                                           lambda: content_length(fork_script, vocab)))


# --- results --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Draw:
  """One sampled choice as the reference made it, kept so that a comparison can ask whether it was a near tie."""

  logits: np.ndarray  # [V] what it drew from: penalized, biased and constrained
  key: jax.Array
  sampling: SamplingConfig

  def near_tie(self, delta: float = NEAR_TIE) -> bool:
    return near_tie(self.logits, self.key, self.sampling, delta)


def draw(constrained, key: jax.Array, sampling: SamplingConfig) -> tuple[int, Draw]:
  """The sampled token of constrained logits [V], and the `Draw` that made it."""
  logits = np.asarray(constrained, np.float32)
  return int(sample(jnp.asarray(logits), key, sampling)), Draw(logits, key, sampling)


@dataclasses.dataclass(frozen=True)
class PoolEntry:
  """One pool slot as the reference wrote it (slot index = write order)."""

  token: int
  thread: int
  position: int
  visible: frozenset[int]  # slots this token attended to when it was written (itself included)


@dataclasses.dataclass(frozen=True, eq=False)
class ReferenceResult:
  """One request's run (docs/interpreter.md, What is recorded).

  records: one per token that became pending, in order (see the module docstring for the order
    inside one step). logits[i] belongs to records[i]: raw model logits [V], None for an inserted
    ASYNC. pool: every written slot, the prompt first. draws[i]: the `Draw` that sampled records[i]'s token,
    None for a forced or inserted one.
  """

  records: list[Record]
  logits: list[np.ndarray | None]
  steps: int
  stalls: int
  finished: bool
  truncated: bool
  pool: list[PoolEntry]
  vocab: TagVocab
  refusals: int = 0  # topics cut at their cap (SamplingConfig.max_topic_tokens) where the model would have gone on
  draws: list[Draw | None] = dataclasses.field(default_factory=list)

  def near_tie(self, i: int) -> bool:
    """Whether records[i]'s token was sampled at a near tie (`NEAR_TIE`): logits equal to the reference's up to
    float rounding may choose another there."""
    return i < len(self.draws) and self.draws[i] is not None and self.draws[i].near_tie()

  @property
  def num_threads(self) -> int:
    return 1 + max((r[2] for r in self.records), default=0)

  def thread_tokens(self, thread: int) -> list[int]:
    """Thread's recorded tokens in order (a fork's start with ASYNC and end with ASYNC_END)."""
    return [r[3] for r in self.records if r[2] == thread]

  def thread_positions(self, thread: int) -> list[int]:
    return [r[4] for r in self.records if r[2] == thread]

  def annotated_tokens(self) -> list[int]:
    """Main's generated tokens (no prompt), each fork's tokens spliced right after its LENGTH.

    Forks spawn in order of main's fed LENGTH tokens, so fork u belongs to main's u-th LENGTH
    token. A final LENGTH that never fed (stall, then truncation) has no fork.
    """
    out, fork = [], 1
    for token in self.thread_tokens(0):
      out.append(token)
      if self.vocab.is_length(token) and fork < self.num_threads:
        out.extend(self.thread_tokens(fork))
        fork += 1
    return out

  def events(self) -> list[tuple[str, int, int]]:
    """(kind, step, thread), ordered by step, derived from the records alone.

    'spawn': the fork's ASYNC record. 'close': the fork's ASYNC_END record (the step it sampled
    its end). 'sync' (thread 0): the step main fed a SYNC, which is the step of main's next record,
    because main samples right after each feed; a SYNC that never fed has no event.
    """
    out = []
    main = [r for r in self.records if r[2] == 0]
    for step, _, thread, token, _ in self.records:
      if thread != 0 and token == self.vocab.async_open:
        out.append(("spawn", step, thread))
      elif thread != 0 and token == self.vocab.async_close:
        out.append(("close", step, thread))
    for before, after in zip(main, main[1:], strict=False):
      if before[3] == self.vocab.sync:
        out.append(("sync", after[0], 0))
    return sorted(out, key=lambda e: e[1])


# --- one request ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Lane:
  state: str = FREE
  thread: int = -1
  token: int = -1  # pending token: the next input, not yet in the pool
  position: int = -1  # the position it will be fed at


@dataclasses.dataclass
class Settings:
  model_fn: Callable
  params: object
  vocab: TagVocab
  lanes: int
  max_threads: int
  pool_slots: int
  max_steps: int
  sampling: SamplingConfig
  position_mode: str
  bucket: bool
  max_depth: int = 3
  initial_threads: int = 1
  sample_after_script: bool = False


class Request:
  """State of one request (docs/interpreter.md, State of one request), with explicit visible sets."""

  def __init__(self, cfg: Settings, index: int, prompt: list[int], script: list[list[int]] | None):
    self.cfg, self.index, self.script = cfg, index, script
    self.vocab = cfg.vocab
    self.lanes = [Lane() for _ in range(cfg.lanes)]
    self.next_thread = 1
    self.cursor: dict[int, int] = {}  # forced mode: next script index per thread
    self.in_promise = False  # main: after PROMISE, before its LENGTH
    self.entries: list[tuple[int, int, int]] = []  # (token, thread, position) per slot
    self.visible: list[frozenset[int]] = []  # per slot: what it attended to
    self.seen: dict[int, set[int]] = {0: set()}  # per thread: slots its next query sees
    self.records: list[Record] = []
    self.logits: list[np.ndarray | None] = []
    self.draws: list[Draw | None] = []
    self._draw: Draw | None = None  # the last sampled choice, until it is recorded
    self.stalls = 0
    self.refusals = 0  # topics cut at the cap where the model would have gone on
    self.last_fed = 0
    self.finished = self.truncated = False
    self._prefill(prompt)

  # -- start ---------------------------------------------------------------------------------------
  def _prefill(self, prompt: list[int]) -> None:
    """Start: the prompt fills slots 0 ... P-1 (owner 0, causal), then main samples at step 0."""
    for i, token in enumerate(prompt):
      self.entries.append((int(token), 0, i))
      self.visible.append(frozenset(range(i + 1)))
      self.seen[0].add(i)
    row = self._model_row(len(prompt) - 1)
    # The three constraint situations (main, main in a promise, fork), sized by the model's vocab.
    self._masks = {key: constraint_mask(self.vocab, row.shape[-1], *key)
                   for key in ((True, False), (True, True), (False, False))}
    self._length_mask = np.zeros((row.shape[-1],), bool)
    self._length_mask[[t for t in self.vocab.lengths if t < row.shape[-1]]] = True
    main = self.lanes[0]
    main.state, main.thread, main.position = RUNNING, 0, len(prompt)
    main.token = self._choose(row, step=0, lane=0, thread=0, slot=len(prompt) - 1)
    self.in_promise = main.token == self.vocab.promise  # the first token may open a promise too
    self._record(0, 0, 0, main.token, main.position, row)

  # -- one step ------------------------------------------------------------------------------------
  def step(self, step: int) -> None:
    """One step (docs/interpreter.md, One step): who feeds, pool room, attention, next tokens."""
    feeders, spawn_lane, sync, done, stall = self._who_feeds()
    if len(self.entries) + len(feeders) > self.cfg.pool_slots:
      # All or nothing: not enough room for every feeding lane, so nothing happens at all.
      self.truncated = True
      return
    self.stalls += stall
    if done:
      self.lanes[0].state = DONE  # the implicit final sync: the end id is never fed
    spawned = self._spawn(step, spawn_lane) if spawn_lane is not None else None
    slots = self._write(feeders, spawned, sync)
    if feeders:
      self.last_fed = step
    for lane in feeders:
      self._next_token(step, lane, slots[lane], spawned)
    self.finished = self.lanes[0].state == DONE and all(x.state == FREE for x in self.lanes[1:])

  def _who_feeds(self) -> tuple[list[int], int | None, bool, bool, bool]:
    """Phase 1: (feeding lanes in lane order, lane a fork spawns on, sync, main done, stall).

    Nothing is changed here, so a step that then fails the pool-room check leaves no trace.
    """
    main, forks = self.lanes[0], self.lanes[1:]
    feeds_main = sync = done = stall = False
    spawn_lane = None
    if main.state == RUNNING:
      token = main.token
      running = any(lane.state == RUNNING for lane in forks)  # closing forks do not block
      if self.vocab.is_length(token):
        # Closing lanes are not free yet: a lane a fork frees is reusable from the next step on.
        free = [i for i, lane in enumerate(forks, start=1) if lane.state == FREE]
        if not free or self.next_thread >= self.cfg.max_threads:
          stall = True
        else:
          feeds_main, spawn_lane = True, free[0]
      elif token == self.vocab.sync or token in self.vocab.eos_ids:
        if running:
          pass  # wait for every running fork
        elif token == self.vocab.sync:
          feeds_main = sync = True
        else:
          done = True
      else:
        feeds_main = True
    feeders = [0] if feeds_main else []
    feeders += [i for i, lane in enumerate(forks, start=1)
                if lane.state in (RUNNING, CLOSING) or i == spawn_lane]
    return feeders, spawn_lane, sync, done, stall

  def _spawn(self, step: int, lane_index: int) -> int:
    """A fork spawns on `lane_index` with the next thread id; ASYNC (inserted) is its pending token
    at position p + 1, p = the LENGTH token's position. Returns the thread id."""
    thread = self.next_thread
    self.next_thread += 1
    main, lane = self.lanes[0], self.lanes[lane_index]
    lane.state, lane.thread = RUNNING, thread
    lane.token, lane.position = self.vocab.async_open, main.position + 1
    self._record(step, lane_index, thread, lane.token, lane.position, None)
    return thread

  def _write(self, feeders: list[int], spawned: int | None, sync: bool) -> dict[int, int]:
    """Phases 2-3: feeders take consecutive slots in lane order; then every visible set is fixed.

    All feeders write first, then all attend: a `<sync/>` query sees the `</async>` tokens written
    by closing forks in the same step, even though they sit in later slots.
    """
    slots = {}
    for index in feeders:
      lane = self.lanes[index]
      slot = len(self.entries)
      self.entries.append((lane.token, lane.thread, lane.position))
      self.visible.append(frozenset())  # fixed below, once every feeder has written
      slots[index] = slot
      if lane.thread == spawned:  # its ASYNC, the fork's first and (this step) only write
        # Main (lane 0) wrote first, so main's set already holds this step's LENGTH token.
        self.seen[spawned] = set(self.seen[0])
      self.seen[lane.thread].add(slot)
    if sync:
      self.seen[0].update(k for k, (_, owner, _) in enumerate(self.entries) if owner != 0)
    for index, slot in slots.items():
      self.visible[slot] = frozenset(self.seen[self.lanes[index].thread])
    return slots

  def _next_token(self, step: int, index: int, slot: int, spawned: int | None) -> None:
    """Phase 4 for one lane that fed: free a closing lane, else choose its next pending token."""
    lane = self.lanes[index]
    if lane.state == CLOSING:
      # It just wrote </async>: its logits are dropped (so never computed) and the lane is free.
      self.lanes[index] = Lane()
      return
    fed = lane.token
    row = self._model_row(slot)
    position = lane.position + 1
    if lane.thread == 0 and self.vocab.is_length(fed):
      position += self._span(fed, spawned)
    token = self._choose(row, step, index, lane.thread, slot)
    if lane.thread == 0:
      if token == self.vocab.promise:
        self.in_promise = True
      elif self.vocab.is_length(token):
        self.in_promise = False
    elif token == self.vocab.async_close or token in self.vocab.eos_ids:
      token, lane.state = self.vocab.async_close, CLOSING  # an end id in a fork counts as </async>
    lane.token, lane.position = token, position
    self._record(step, index, lane.thread, token, position, row)

  # -- helpers -------------------------------------------------------------------------------------
  def _span(self, length_token: int, thread: int) -> int:
    fork_script = None
    if self.script is not None:
      fork_script = self.script[thread] if thread < len(self.script) else []
    return span_for(self.cfg.position_mode, length_token, self.vocab, fork_script)

  def _model_row(self, slot: int) -> np.ndarray:
    return model_row(self.cfg.model_fn, self.cfg.params, self.entries, self.visible, slot, self.cfg.bucket)

  def _choose(self, row: np.ndarray, step: int, lane: int, thread: int, slot: int) -> int:
    """The lane's next token: from its thread's script in forced mode, else sampled constrained (after the
    repetition penalty over what the query in `slot` sees)."""
    if self.script is not None:
      return self._forced(thread)
    row = penalized_row(row, self.entries, self.visible[slot], self.cfg.sampling, self.vocab)
    allowed = self._masks[(thread == 0, thread == 0 and self.in_promise)]
    in_topic = thread == 0 and self.in_promise
    main_ids = [token for token, owner, _ in self.entries if owner == 0] if in_topic else []
    if in_topic and self.cfg.sampling.distinct_topics and repeats_earlier_topic(main_ids, self.vocab):
      allowed = allowed & ~self._length_mask  # main may not close a topic it already used
    cap = self.cfg.sampling.max_topic_tokens
    if in_topic and cap and len(promise_topics(main_ids, self.vocab)[1]) >= cap:
      # the topic has its most tokens: only a LENGTH, and a cut counts where the model's choice was to go on
      self.refusals += not self._length_mask[int(np.argmax(np.where(allowed, row, -np.inf)))]
      allowed = self._length_mask
    key = lane_key(jax.random.key(self.cfg.sampling.seed), self.index, step, lane)
    token, self._draw = draw(constrain_logits(row, allowed), key, self.cfg.sampling)
    return token

  def _forced(self, thread: int) -> int:
    """Next token of the thread's script; an exhausted script gives an end id (main) / ASYNC_END."""
    seq = self.script[thread] if thread < len(self.script) else []
    i = self.cursor.get(thread, 0)
    self.cursor[thread] = i + 1
    if i < len(seq):
      return int(seq[i])
    return self.vocab.eos_ids[0] if thread == 0 else self.vocab.async_close

  def _record(self, step: int, lane: int, thread: int, token: int, position: int, row) -> None:
    """What is recorded: one (step, lane, thread, token, position) per token that becomes pending."""
    self.records.append((step, lane, thread, int(token), int(position)))
    self.logits.append(row)
    self.draws.append(self._draw)
    self._draw = None

  def result(self) -> ReferenceResult:
    pool = [PoolEntry(t, u, p, v) for (t, u, p), v in zip(self.entries, self.visible, strict=True)]
    return ReferenceResult(records=list(self.records), logits=list(self.logits), steps=self.last_fed,
                           stalls=self.stalls, finished=self.finished, truncated=self.truncated, pool=pool,
                           vocab=self.vocab, refusals=self.refusals, draws=list(self.draws))


def model_row(model_fn, params, entries: list[tuple[int, int, int]], visible: list[frozenset[int]], slot: int,
              bucket: bool) -> np.ndarray:
  """Raw logits [V] of the token in `slot`, from one model call on exactly what it sees: its visible slots in
  write order, each (token, thread, position) in `entries`, each row masked by its own visible set."""
  keys = sorted(visible[slot])
  for k in keys:  # visibility is closed: whatever a visible token saw, the query sees too
    assert visible[k] <= visible[slot], (slot, k)
  n = len(keys)
  width = _bucket(n) if bucket else n
  tokens = np.zeros((1, width), np.int32)
  positions = np.zeros((1, width), np.int32)
  tokens[0, :n] = [entries[k][0] for k in keys]
  positions[0, :n] = [entries[k][2] for k in keys]
  # Pad rows see only themselves (no empty softmax row) and no real row sees them.
  mask = np.eye(width, dtype=bool)[None]
  mask[0, :n, :n] = [[j in visible[i] for j in keys] for i in keys]
  logits = model_fn(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), None, None, None).logits
  # The query's own row: the last row except for a sync, which sees slots written after it in the same step.
  return np.asarray(logits[0, keys.index(slot)], np.float32)


def _bucket(n: int) -> int:
  """Padded length of a model call: the next power of two, at least 8 (few shapes to compile)."""
  return max(8, 1 << (n - 1).bit_length())


# --- entry point ----------------------------------------------------------------------------------
