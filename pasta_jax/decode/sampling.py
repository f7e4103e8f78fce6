"""Token sampling: greedy, temperature, top-k, top-p, and the repetition penalty (CTRL's, as in Hugging Face's
`repetition_penalty`, applied before any of them), all on device.

A request's settings are a `SamplingConfig`. On device they are per-row values (`RowSampling`, traced), so
requests with any settings share one batch and one compiled program, as in vLLM. What the program can do at all
is static, the config's `SamplingConfig.envelope()`: a greedy-only program never truncates or draws, a program
without a penalty never reads what a row sees; inside the envelope each row chooses by its own values (a row
at temperature 0 takes the argmax), and a step skips the sampling, truncation or penalty work (`lax.cond`)
when none of its rows needs it.

`fork_bias` is PASTA's speed/quality knob, a per-row value like the others: a logit offset on the tokens that
open a promise (`decode.constraints.bias_fork_open`, added in the step after the penalty), so a positive bias makes
main fork more often and a negative one less. A method without promises refuses a non-zero bias
(`methods.base.Method.check_request`). 0 is off: a program whose rows all leave it at 0 has no bias path at all.

`max_topic_tokens` caps a PASTA promise's topic, per row as well: once main has written that many topic tokens it may
write only a LENGTH, so a topic cannot run on to the end of the answer (a high fork bias on a weak model writes the
whole answer into one never-closed topic). 0 is off, and again a program whose rows all leave it off has no cap path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEED_LIMIT = 1 << 32
TOPIC_LIMIT = 1 << 16  # max_topic_tokens below it (a topic is a few words; a pool holds a few thousand tokens)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  seed: int = 0  # in [0, 2**32)
  # > 1 discourages every token the row already sees (its visible context: the prompt, and what its thread
  # and the threads it sees wrote); 1 = off. Tags and end ids are never penalized: they are the language.
  repetition_penalty: float = 1.0
  # PASTA: main may not close a promise whose topic repeats one of its earlier promises' (its LENGTH tokens are
  # forbidden until the topic differs). Forks see only their promise's topic, so siblings with one topic write
  # the same block under greedy decoding (lang.tokens.repeats_earlier_topic). Static: a program's, not a row's.
  distinct_topics: bool = False
  # PASTA: added to the logit of the token that opens a promise wherever the rules let one open (main outside a
  # promise), after the repetition penalty; > 0 forks more, < 0 less; 0 = off (decode.constraints.bias_fork_open).
  fork_bias: float = 0.0
  # PASTA: the most tokens a promise's topic may have; main then may write only a LENGTH (each such cut of a topic
  # the model would have continued is counted: `Result.refusals`); 0 = no cap (decode.rules.pasta).
  max_topic_tokens: int = 0

  def __post_init__(self):
    if (not self.temperature >= 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not self.repetition_penalty > 0
        or not 0 <= self.seed < SEED_LIMIT or not math.isfinite(self.fork_bias)
        or not 0 <= self.max_topic_tokens < TOPIC_LIMIT):
      raise ValueError(f"bad sampling settings {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                       "repetition_penalty > 0, 0 <= seed < 2**32, a finite fork_bias, "
                       f"0 <= max_topic_tokens < {TOPIC_LIMIT}")

  @property
  def penalizes(self) -> bool:
    return self.repetition_penalty != 1.0

  @property
  def biases_forks(self) -> bool:
    return self.fork_bias != 0.0

  @property
  def caps_topics(self) -> bool:
    return self.max_topic_tokens > 0

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def truncates(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

  def envelope(self) -> SamplingConfig:
    """The static part: which paths a compiled step has (sampling, truncation, penalty, fork bias, topic cap,
    distinct topics), one canonical config per combination, so every config with the same paths shares a program."""
    return SamplingConfig(temperature=0.0 if self.greedy else 1.0, top_p=0.5 if self.truncates else 1.0,
                          repetition_penalty=2.0 if self.penalizes else 1.0, distinct_topics=self.distinct_topics,
                          fork_bias=1.0 if self.biases_forks else 0.0, max_topic_tokens=int(self.caps_topics))

  def covers(self, row: SamplingConfig) -> bool:
    """Whether a program compiled for this config's envelope can run a row with `row`'s settings."""
    return ((not self.greedy or row.greedy) and (self.truncates or not row.truncates)
            and (self.penalizes or not row.penalizes) and (self.biases_forks or not row.biases_forks)
            and (self.caps_topics or not row.caps_topics) and self.distinct_topics == row.distinct_topics)

  @staticmethod
  def covering(rows: Sequence[SamplingConfig]) -> SamplingConfig:
    """The smallest envelope that runs every one of `rows` (they must agree on distinct_topics)."""
    topics = {r.distinct_topics for r in rows}
    if len(topics) != 1:
      raise ValueError("distinct_topics is a program's setting: give every request of one run the same value")
    return SamplingConfig(temperature=0.0 if all(r.greedy for r in rows) else 1.0,
                          top_p=0.5 if any(r.truncates for r in rows) else 1.0,
                          repetition_penalty=2.0 if any(r.penalizes for r in rows) else 1.0,
                          fork_bias=1.0 if any(r.biases_forks for r in rows) else 0.0,
                          max_topic_tokens=int(any(r.caps_topics for r in rows)),
                          distinct_topics=topics.pop()).envelope()


# every path: a server's batches (`serve.batches.batch_key` drops the fork bias and the topic cap for a method that
# has no promise or no topic)
ANY_SAMPLING = SamplingConfig(temperature=1.0, top_p=0.5, repetition_penalty=2.0, fork_bias=1.0, max_topic_tokens=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
  """Each row's sampling values on device, and what its random keys fold in: every leaf [B]."""

  temperature: jax.Array  # float32, 0: greedy
  top_k: jax.Array  # int32, 0: off
  top_p: jax.Array  # float32, 1: off
  penalty: jax.Array  # float32, 1: off
  fork_bias: jax.Array  # float32 added to the promise-open logit where a promise may open, 0: off
  max_topic: jax.Array  # int32 the most tokens a promise's topic may have, 0: no cap
  seed: jax.Array  # uint32
  stream: jax.Array  # int32 the request index folded into its keys (its place in `generate`; 0 in a server)
  first_step: jax.Array  # int32 the batch step the row's own steps count from (its admission)

  @staticmethod
  def of(rows: Sequence[SamplingConfig], streams: Sequence[int] | None = None) -> RowSampling:
    """Host arrays for `rows` (request i folds in `streams[i]`, by default i)."""
    streams = range(len(rows)) if streams is None else streams
    return RowSampling(temperature=np.array([r.temperature for r in rows], np.float32),
                       top_k=np.array([r.top_k for r in rows], np.int32),
                       top_p=np.array([r.top_p for r in rows], np.float32),
                       penalty=np.array([r.repetition_penalty for r in rows], np.float32),
                       fork_bias=np.array([r.fork_bias for r in rows], np.float32),
                       max_topic=np.array([r.max_topic_tokens for r in rows], np.int32),
                       seed=np.array([r.seed for r in rows], np.uint32),
                       stream=np.asarray(streams, np.int32), first_step=np.zeros(len(rows), np.int32))

  def lane_keys(self, step: jax.Array, lanes: jax.Array) -> jax.Array:
    """[B, Q] keys of lanes [B, Q] at batch step `step`: each row's own seed, stream and steps since admission."""
    def row(seed, stream, first_step, row_lanes):
      base = jax.random.key(seed)
      return jax.vmap(lambda lane: lane_key(base, stream, step - first_step, lane))(row_lanes)
    return jax.vmap(row)(self.seed, self.stream, self.first_step, lanes)


def first_max_index(x: jax.Array) -> jax.Array:
  """`jnp.argmax(x, axis=-1)` (the first maximum's index; a NaN counts as the maximum) as int32, in two fused
  passes, a max and a min over the matching indices. XLA's CPU argmax is a variadic reduce that runs at a
  quarter of a max's speed: over 262k logits on a 2-core CPU it costs 0.78 ms a row against 0.38 for this, and
  1.57 ms against 0.96 for 4 rows (every greedy step pays it)."""
  top = jnp.max(x, axis=-1, keepdims=True)
  hit = (x == top) | jnp.isnan(x)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def lane_key(base: jax.Array, request: jax.Array, step: jax.Array, lane: jax.Array) -> jax.Array:
  """The RNG key of one lane at one step: the same in the jitted loop and the reference."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, request), step), lane)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """One token from logits [V] (already constrained with -inf) under one request's settings. Returns int32 [].
  The same computation as a row of `sample_rows` (the references use it)."""
  return _sample_one(logits, key, RowSampling.of([cfg]), envelope=cfg.envelope())


def near_tie(logits, key: jax.Array, cfg: SamplingConfig, delta: float) -> bool:
  """Whether `sample(logits, key, cfg)` picks another token once each logit moves by at most `delta`: a choice
  that two computations of the same logits, equal up to float rounding, may make differently. The pushes tried are
  the ones that move each comparison the sampler makes: the argmax's gap to the runner-up (greedy), the running
  mass before and through the drawn token in the inverse CDF's order (a draw), and the mass above it (the top-k and
  top-p cut-offs)."""
  logits = np.asarray(logits, np.float32)
  token = int(sample(jnp.asarray(logits), key, cfg))
  if cfg.temperature == 0:
    runner_up = np.delete(logits, token).max(initial=-np.inf)
    return bool(logits[token] - runner_up <= 2 * delta)
  order = draw_order(logits.shape[-1])
  above = logits > logits[token]
  pushes = (order < order[token], order > order[token], above, ~above)  # the tokens whose logits rise by delta
  return any(int(sample(jnp.asarray(logits + np.where(up, delta, -delta).astype(np.float32)), key, cfg)) != token
             for up in pushes)


def draw_order(vocab: int) -> np.ndarray:
  """[V] each token's rank in the walk of a draw's inverse CDF: column by column (`_columns`), row by row in one."""
  columns = min(COLUMNS, vocab)
  token = np.arange(vocab)
  return (token % columns) * -(-vocab // columns) + token // columns


@functools.partial(jax.jit, static_argnames="envelope")
def _sample_one(logits: jax.Array, key: jax.Array, rows: RowSampling, envelope: SamplingConfig) -> jax.Array:
  """`sample` compiled once per envelope and vocabulary (the references call it for every token: op by op, its
  conds and loops would cost milliseconds each)."""
  return sample_rows(logits[None], key[None], rows, envelope)[0]


def sample_rows(logits: jax.Array, keys: jax.Array, rows: RowSampling, envelope: SamplingConfig) -> jax.Array:
  """Rows of logits [N, V] with keys [N] and each row's settings (`rows`, leaves [N]) -> tokens [N]. Only the
  paths of `envelope` are compiled; a row at temperature 0 takes the first argmax.

  A hot row draws by inverse CDF from its temperature's softmax (restricted to its top-k), and a top-p row keeps
  its first draw inside its nucleus (rejection: exact, and each try costs one pass over the row, where the sort
  HF's definition reads costs seconds for a 262k vocabulary on a CPU); after `PROPOSALS` tries it draws from
  its nucleus, whose threshold `_nucleus_floor` finds. A row's draw reads only its own logits, settings and key,
  so a row draws the same token in any batch."""
  if envelope.greedy:
    return first_max_index(logits)
  hot = rows.temperature > 0
  # A batch of hot rows skips the argmax: over 262k logits it costs a CPU more than a draw.
  greedy = jax.lax.cond(jnp.all(hot), lambda: jnp.zeros(logits.shape[0], jnp.int32), lambda: first_max_index(logits))

  def draw():
    scaled = logits.astype(jnp.float32) / jnp.where(hot, rows.temperature, 1.0)[:, None]
    if not envelope.truncates:
      return _draw(scaled, keys, None, None)
    return _draw(scaled, keys, jnp.where(hot, rows.top_k, 0), jnp.where(hot, rows.top_p, 1.0))

  sampled = jax.lax.cond(jnp.any(hot), draw, lambda: greedy)
  return jnp.where(hot, sampled, greedy)


# lax.top_k's width (about a third of a greedy step over 262k logits on a CPU): a row's k-th logit up to this
# top_k is read there, and a nucleus of at most this many tokens is found there; a larger one is found by a
# search over the logits' bits (32 passes).
TOP_K_CANDIDATES = 256
# Draws a top-p row tries before it looks for its nucleus's threshold. A try is accepted with probability at
# least top_p, so at 0.5 one row in 256 looks.
PROPOSALS = 8
# The inverse CDF's table: the vocabulary as COLUMNS strided columns (token r * COLUMNS + c is row r of column c).
# One pass gives every column's mass; a draw picks a column by them, then a token of it: two short running sums
# where one over the vocabulary would cost more than a greedy step (XLA's CPU cumsum: about 40 ms for 16 x 262k).
COLUMNS = 512
NEG = float(np.finfo(np.float32).min)


def truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits [N, V] with every token outside each row's top-k (top_k [N], 0: off) and outside the smallest
  prefix of its sorted top-k distribution whose mass reaches top_p (top_p [N], 1: off; Hugging Face's order:
  top-k, then top-p on what is left) set to the float32 minimum.
  The most likely token always stays; tokens tied with the last kept one stay too. No sort of the vocabulary:
  the thresholds come from a lax.top_k of TOP_K_CANDIDATES logits, or past it from searches over the logits' bits
  (`kept_floor`); `sample_rows` draws from the same set."""
  logits = logits.astype(jnp.float32)
  return jnp.where(logits < kept_floor(logits, top_k, top_p)[:, None], NEG, logits)


def kept_floor(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, candidates: int = TOP_K_CANDIDATES
               ) -> jax.Array:
  """[N] the smallest float each row keeps under `truncate` (-inf: it keeps every token); its lax.top_k reads
  `candidates` logits a row (fewer only make it search more)."""
  logits = logits.astype(jnp.float32)
  x = _columns(logits)
  top = jnp.max(logits, axis=-1)
  floor = _top_k_floor(logits, top_k, candidates)
  total = jnp.sum(_column_mass(x, top, x >= floor[:, None, None]), axis=-1)
  nucleus = _nucleus_floor(logits, x, top, floor, top_p * total, top_p < 1.0, candidates)
  return jnp.where(top_p < 1.0, nucleus, floor)


def _draw(logits: jax.Array, keys: jax.Array, top_k: jax.Array | None, top_p: jax.Array | None) -> jax.Array:
  """One token per row of logits [N, V] (already scaled by temperature) under its top_k and top_p (None: off for
  every row: the program has no truncation)."""
  rows = logits.shape[0]
  x = _columns(logits)
  top = jnp.max(logits, axis=-1)
  off = jnp.full((rows,), -jnp.inf, jnp.float32)
  if top_k is None:
    return _Table.of(x, top, off).draw(keys, 0)
  floor = jax.lax.cond(jnp.any(top_k > 0), lambda: _top_k_floor(logits, top_k), lambda: off)
  table = _Table.of(x, top, floor)
  nucleus = top_p < 1.0

  def rejection():
    budget = top_p * table.total  # a token is in the nucleus iff the mass above it is below this (`kept_floor`)

    def attempt(state):
      tries, token, done = state
      value = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
      done = done | (_mass_above(x, top, value) < budget)
      return tries + 1, jnp.where(done, token, table.draw(keys, tries + 1)), done

    _, token, done = jax.lax.while_loop(lambda s: (s[0] < PROPOSALS) & jnp.any(~s[2]), attempt,
                                        (jnp.int32(0), table.draw(keys, 0), ~nucleus))

    def search():
      kept = _nucleus_floor(logits, x, top, floor, budget, ~done, TOP_K_CANDIDATES)
      return jnp.where(done, token, _Table.of(x, top, kept).draw(keys, PROPOSALS))

    return jax.lax.cond(jnp.any(~done), search, lambda: token)

  return jax.lax.cond(jnp.any(nucleus), rejection, lambda: table.draw(keys, 0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Table:
  """Each row's distribution softmax(x) over the tokens at or above its floor, laid out for the inverse CDF."""

  x: jax.Array  # [N, R, C] logits (`_columns`)
  top: jax.Array  # [N] each row's largest logit
  floor: jax.Array  # [N]
  column_mass: jax.Array  # [N, C] each column's unnormalized mass, exp(x - top) summed

  @staticmethod
  def of(x: jax.Array, top: jax.Array, floor: jax.Array) -> _Table:
    return _Table(x, top, floor, _column_mass(x, top, x >= floor[:, None, None]))

  @property
  def total(self) -> jax.Array:
    return jnp.sum(self.column_mass, axis=-1)

  def draw(self, keys: jax.Array, attempt) -> jax.Array:
    """[N] one token per row, from two uniforms of its key folded with `attempt`: one picks a column by the
    columns' masses, the other a token of that column by the tokens' masses (a row's CDF, in two steps)."""
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, attempt), (2,)))(keys)
    column = _inverse_cdf(self.column_mass, u[:, 0])
    x = jnp.take_along_axis(self.x, column[:, None, None], axis=2)[..., 0]  # [N, R]
    mass = jnp.where(x >= self.floor[:, None], jnp.exp(x - self.top[:, None]), 0.0)
    return _inverse_cdf(mass, u[:, 1]) * self.x.shape[2] + column


def _inverse_cdf(mass: jax.Array, u: jax.Array) -> jax.Array:
  """[N] the first index whose running sum of mass [N, M] (>= 0) passes u [N] (in [0, 1)) times the total. An
  index of mass 0 is never picked (its running sum equals the one before); where rounding leaves u * total at the
  total, the last index with mass is."""
  running = jnp.cumsum(mass, axis=-1)
  picked = jnp.sum(running <= (u * running[:, -1])[:, None], axis=-1, dtype=jnp.int32)
  index = jax.lax.broadcasted_iota(jnp.int32, mass.shape, 1)
  last = jnp.max(jnp.where(mass > 0, index, 0), axis=-1)
  return jnp.minimum(picked, last)


def _columns(logits: jax.Array) -> jax.Array:
  """logits [N, V] as [N, R, C] (token r * C + c at [:, r, c]): C = COLUMNS, the vocabulary padded with -inf (mass
  0) to a multiple of it; a vocabulary under COLUMNS is one row."""
  rows, vocab = logits.shape
  columns = min(COLUMNS, vocab)
  padded = -(-vocab // columns) * columns
  if padded != vocab:
    logits = jnp.pad(logits, ((0, 0), (0, padded - vocab)), constant_values=-jnp.inf)
  return logits.reshape(rows, padded // columns, columns)


def _column_mass(x: jax.Array, top: jax.Array, keep: jax.Array) -> jax.Array:
  """[N, C] the unnormalized mass exp(x - top) of the kept tokens (keep [N, R, C]) of each column.
  Every mass this module compares is a sum of these, in this order, so the comparisons agree with each other."""
  return jnp.sum(jnp.where(keep, jnp.exp(x - top[:, None, None]), 0.0), axis=1)


def _mass_above(x: jax.Array, top: jax.Array, value: jax.Array) -> jax.Array:
  """[N] the unnormalized mass of each row's tokens whose logit is above its `value` [N]."""
  return jnp.sum(_column_mass(x, top, x > value[:, None, None]), axis=-1)


def _top_k_floor(logits: jax.Array, top_k: jax.Array, candidates: int = TOP_K_CANDIDATES) -> jax.Array:
  """[N] each row's k-th largest logit, counting ties (-inf where top_k is 0; its smallest logit where top_k is
  past its tokens): lax.top_k's where every row's top_k is at most `candidates`, else a counting search for the
  rows past it."""
  vocab = logits.shape[-1]
  width = min(candidates, vocab)
  best = jax.lax.top_k(logits, width)[0]  # [N, width] descending
  kth = jnp.take_along_axis(best, (jnp.clip(top_k, 1, width) - 1)[:, None], axis=-1)[:, 0]
  wide = top_k > width
  kth = jax.lax.cond(jnp.any(wide), lambda: jnp.where(wide, _count_floor(logits, top_k), kth), lambda: kth)
  return jnp.where(top_k > 0, kth, -jnp.inf)


def _count_floor(logits: jax.Array, k: jax.Array) -> jax.Array:
  """[N] each row's k-th largest logit (k [N]; its smallest where it has fewer than k tokens), by bisection over
  the floats' order for the largest float with at least k logits at or above it (at most 32 passes, each a
  count)."""
  lo = _ordered(jnp.full(k.shape, -jnp.inf, jnp.float32))  # count(x >= -inf) is every token: never tested
  hi = _ordered(jnp.max(logits, axis=-1)) + 1  # nothing is above the largest logit: never tested

  def step(state):
    lo, hi = state
    mid = lo + (hi - lo) // 2
    enough = jnp.sum(logits >= _unordered(mid)[:, None], axis=-1, dtype=jnp.int32) >= k
    open_ = hi - lo > 1
    return jnp.where(open_ & enough, mid, lo), jnp.where(open_ & ~enough, mid, hi)

  lo, _ = jax.lax.while_loop(lambda s: jnp.any(s[1] - s[0] > 1), step, (lo, hi))
  return _lowest_at_or_above(logits, _unordered(lo))


def _nucleus_floor(logits: jax.Array, x: jax.Array, top: jax.Array, floor: jax.Array, budget: jax.Array,
                  need: jax.Array, candidates: int = TOP_K_CANDIDATES) -> jax.Array:
  """[N] for the rows in `need` [N], a float whose logits at or above it are exactly the row's tokens at or above
  `floor` with less than `budget` of mass above them (`_mass_above`): the top-p rule (a prefix of the sorted tokens
  keeps a token while the mass before it is below p; tied tokens have one mass above them, so stay or go
  together). logits [N, V] and x, top: the same logits as `_Table` reads them.

  First from the row's `candidates` largest logits (lax.top_k): their running mass guesses the last kept one,
  and two passes check the guess (the guess is in, the next lower candidate out); a row whose nucleus is wider,
  or whose guess rounding moved, is bisected (`_bisect_nucleus`)."""
  width = min(candidates, logits.shape[-1])
  best = jax.lax.top_k(logits, width)[0]  # [N, width] descending: every logit above best[:, -1] is here
  mass = jnp.where(best >= floor[:, None], jnp.exp(best - top[:, None]), 0.0)
  before = jnp.cumsum(mass, axis=-1) - mass
  last = jnp.maximum(jnp.sum(before < budget[:, None], axis=-1) - 1, 0)
  guess = jnp.take_along_axis(best, last[:, None], axis=-1)[:, 0]
  lower = jnp.max(jnp.where(best < guess[:, None], best, -jnp.inf), axis=-1)  # the next logit down, if here
  sure = ((lower > -jnp.inf) & (_mass_above(x, top, guess) < budget) & (_mass_above(x, top, lower) >= budget))
  guess = jnp.maximum(guess, floor)  # the top-k's whole mass is >= budget: nothing below its floor is in
  unsure = need & ~sure
  return jax.lax.cond(jnp.any(unsure), lambda: jnp.where(sure, guess, _bisect_nucleus(x, top, floor, budget)),
                      lambda: guess)


def _bisect_nucleus(x: jax.Array, top: jax.Array, floor: jax.Array, budget: jax.Array) -> jax.Array:
  """[N] the smallest logit at or above the smallest float t >= floor whose mass above (`_mass_above`) is below
  budget [N] (`_nucleus_floor`), by bisection over the floats' order: at most 32 passes over the row, each one
  masked sum."""
  lo = _ordered(floor) - 1  # below the floor the whole top-k mass is above: never tested
  hi = _ordered(top)  # nothing is above the largest logit: mass 0 < budget

  def step(state):
    lo, hi = state
    mid = lo + (hi - lo) // 2
    inside = _mass_above(x, top, _unordered(mid)) < budget
    open_ = hi - lo > 1
    return jnp.where(open_ & ~inside, mid, lo), jnp.where(open_ & inside, mid, hi)

  _, hi = jax.lax.while_loop(lambda s: jnp.any(s[1] - s[0] > 1), step, (lo, hi))
  return _lowest_at_or_above(x.reshape(x.shape[0], -1), _unordered(hi))


def _lowest_at_or_above(logits: jax.Array, bound: jax.Array) -> jax.Array:
  """[N] each row's smallest logit >= its bound [N]: a search's float as the logit it stands for (the same tokens
  are at or above either). A search can end on a subnormal float, which a CPU that flushes them compares as 0
  (and a host that does not, as itself)."""
  return jnp.min(jnp.where(logits >= bound[:, None], logits, jnp.inf), axis=-1)


def _ordered(value: jax.Array) -> jax.Array:
  """float32 -> uint32 in the floats' order (-inf lowest; -0.0 just below +0.0), for bisection over floats."""
  bits = jax.lax.bitcast_convert_type(value, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unordered(key: jax.Array) -> jax.Array:
  """The inverse of `_ordered`."""
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def penalize_repeats(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
  """CTRL's repetition penalty: the logit of each seen token is divided by `penalty` if positive and
  multiplied by it if not (so > 1 always makes it less likely). logits, seen: [..., V] (seen bool); penalty: a
  number or an array that broadcasts against them (per row: [B, 1, 1])."""
  penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
  return jnp.where(seen, penalized, logits)
