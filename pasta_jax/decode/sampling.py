"""Token sampling: greedy, temperature, top-k, top-p, and the repetition penalty (CTRL's, as in Hugging Face's
`repetition_penalty`, applied before any of them), all on device.

A request's settings are a `SamplingConfig`. On device they are per-row values (`RowSampling`, traced), so
requests with any settings share one batch and one compiled program, as in vLLM. What the program can do at all
is static, the config's `SamplingConfig.envelope()`: a greedy-only program never sorts or draws, a program
without a penalty never reads what a row sees; inside the envelope each row chooses by its own values (a row
at temperature 0 takes the argmax), and a step skips the sampling, truncation or penalty work (`lax.cond`)
when none of its rows needs it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEED_LIMIT = 1 << 32


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

  def __post_init__(self):
    if (not self.temperature >= 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not self.repetition_penalty > 0
        or not 0 <= self.seed < SEED_LIMIT):
      raise ValueError(f"bad sampling settings {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                       "repetition_penalty > 0, 0 <= seed < 2**32")

  @property
  def penalizes(self) -> bool:
    return self.repetition_penalty != 1.0

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def truncates(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

  def envelope(self) -> SamplingConfig:
    """The static part: which paths a compiled step has (sampling, truncation, penalty, distinct topics), one
    canonical config per combination, so every config with the same paths shares a program."""
    return SamplingConfig(temperature=0.0 if self.greedy else 1.0, top_p=0.5 if self.truncates else 1.0,
                          repetition_penalty=2.0 if self.penalizes else 1.0, distinct_topics=self.distinct_topics)

  def covers(self, row: SamplingConfig) -> bool:
    """Whether a program compiled for this config's envelope can run a row with `row`'s settings."""
    return ((not self.greedy or row.greedy) and (self.truncates or not row.truncates)
            and (self.penalizes or not row.penalizes) and self.distinct_topics == row.distinct_topics)

  @staticmethod
  def covering(rows: Sequence[SamplingConfig]) -> SamplingConfig:
    """The smallest envelope that runs every one of `rows` (they must agree on distinct_topics)."""
    topics = {r.distinct_topics for r in rows}
    if len(topics) != 1:
      raise ValueError("distinct_topics is a program's setting: give every request of one run the same value")
    return SamplingConfig(temperature=0.0 if all(r.greedy for r in rows) else 1.0,
                          top_p=0.5 if any(r.truncates for r in rows) else 1.0,
                          repetition_penalty=2.0 if any(r.penalizes for r in rows) else 1.0,
                          distinct_topics=topics.pop()).envelope()


ANY_SAMPLING = SamplingConfig(temperature=1.0, top_p=0.5, repetition_penalty=2.0)  # every path: a server's batches


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
  """Each row's sampling values on device, and what its random keys fold in: every leaf [B]."""

  temperature: jax.Array  # float32, 0: greedy
  top_k: jax.Array  # int32, 0: off
  top_p: jax.Array  # float32, 1: off
  penalty: jax.Array  # float32, 1: off
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


@functools.partial(jax.jit, static_argnames="envelope")
def _sample_one(logits: jax.Array, key: jax.Array, rows: RowSampling, envelope: SamplingConfig) -> jax.Array:
  """`sample` compiled once per envelope and vocabulary (the references call it for every token: op by op, its
  conds and sorts would cost milliseconds each)."""
  return sample_rows(logits[None], key[None], rows, envelope)[0]


def sample_rows(logits: jax.Array, keys: jax.Array, rows: RowSampling, envelope: SamplingConfig) -> jax.Array:
  """Rows of logits [N, V] with keys [N] and each row's settings (`rows`, leaves [N]) -> tokens [N]. Only the
  paths of `envelope` are compiled; a row at temperature 0 takes the first argmax."""
  greedy = first_max_index(logits)
  if envelope.greedy:
    return greedy
  hot = rows.temperature > 0

  def draw():
    scaled = logits.astype(jnp.float32) / jnp.where(hot, rows.temperature, 1.0)[:, None]
    if envelope.truncates:
      cut = hot & ((rows.top_k > 0) | (rows.top_p < 1.0))
      scaled = jax.lax.cond(jnp.any(cut), lambda: truncate(scaled, rows.top_k, rows.top_p), lambda: scaled)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

  sampled = jax.lax.cond(jnp.any(hot), draw, lambda: greedy)
  return jnp.where(hot, sampled, greedy)


def truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits [N, V] with every token outside each row's top-k (top_k [N], 0: off) and outside the smallest
  prefix of its sorted top-k distribution whose mass reaches top_p (top_p [N], 1: off; Hugging Face's order:
  top-k, then top-p on what is left) set to the float32 minimum.
  The most likely token always stays; tokens tied with the last kept one stay too."""
  neg = jnp.finfo(jnp.float32).min
  ordered = -jnp.sort(-logits, axis=-1)  # [N, V] descending
  vocab = logits.shape[-1]
  kth = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)[:, 0]
  kth = jnp.where(top_k > 0, kth, -jnp.inf)
  in_k = (top_k[:, None] <= 0) | (jnp.arange(vocab)[None, :] < top_k[:, None])  # top-p reads the top-k's mass
  probs = jax.nn.softmax(jnp.where(in_k, ordered, neg), axis=-1)
  kept = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # a prefix: mass before each token < top_p
  last = jnp.sum(kept, axis=-1) - 1  # >= 0: the first token is always kept
  pth = jnp.take_along_axis(ordered, last[:, None], axis=-1)[:, 0]
  pth = jnp.where(top_p < 1.0, pth, -jnp.inf)
  return jnp.where(logits < jnp.maximum(kth, pth)[:, None], neg, logits)


def penalize_repeats(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
  """CTRL's repetition penalty: the logit of each seen token is divided by `penalty` if positive and
  multiplied by it if not (so > 1 always makes it less likely). logits, seen: [..., V] (seen bool); penalty: a
  number or an array that broadcasts against them (per row: [B, 1, 1])."""
  penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
  return jnp.where(seen, penalized, logits)
