"""Skeleton-of-Thought as a served request: its two stages run as internal requests of the engine.

Stage 1 decodes the skeleton in the sequential batch (plain decoding of `SKELETON_PROMPT`, never shown to
the client). With at least `min_points` numbered points, stage 2 expands them in one row of the `sot`
batch: the row's threads fan out after the shared prefix, each forced through its point prompt (a
script), then sampling; rows with fewer points than the batch's fan-out end the spare threads after one
step (their script is two end ids). Without a skeleton the question is answered by plain decoding instead, as
`pasta_jax.baselines.sot.SkeletonOfThought` does; the served text equals that class's, token for token.

The client sees the joined answer ("1. title: expansion\\n2. ..."), streamed point by point: a point's
text goes out once it and every point before it are finished.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pasta_jax.baselines import sot
from pasta_jax.decode import loop
from pasta_jax.decode.batching import bucket
from pasta_jax.lang.schema import THREAD, TOKEN
from pasta_jax.methods import Sequential

EXPAND_POOL_FACTOR = 2  # the expansion batch's rows hold this many times the server's --pool (SoT's fan-out)

PLAN = Sequential()  # the batch that decodes skeletons and the answers without one (the expansions: the server's
# `Sot` with its fan-out, `Engine.expand_method`)


@dataclasses.dataclass(frozen=True)
class Expansion:
  """What stage 2 needs to render its row's records as the joined answer."""

  points: tuple[str, ...]
  suffix_lens: tuple[int, ...]  # each point's forced prompt, skipped in its thread's text

  def text(self, records: np.ndarray, lang, vocab, final: bool) -> str:
    """The joined answer of the points that are settled: all of them when `final`, else the finished prefix."""
    shown = len(self.points) if final else _finished_prefix(records, len(self.points), vocab)
    bodies = [sot.point_expansion(records, u, self.suffix_lens[u], lang, vocab) for u in range(shown)]
    return sot.join_points(self.points[:shown], bodies) + ("\n" if 0 < shown < len(self.points) else "")


def _finished_prefix(records: np.ndarray, points: int, vocab) -> int:
  """How many points, from the first, have written their end id."""
  ends = np.isin(records[:, TOKEN], vocab.eos_ids)
  done = set(records[ends, THREAD].tolist())
  shown = 0
  while shown < points and shown in done:
    shown += 1
  return shown


def stage_two(tokenizer, question: str, skeleton: str, config: sot.SotConfig, fan_out: int, script_width: int,
              end_id: int):
  """(prompt ids, per-thread scripts, Expansion) for a skeleton, or (None, None, note) when the question
  is answered plainly instead: fewer than min_points points, or a point prompt longer than the batch takes."""
  points = sot.extract_points(skeleton, min(config.max_points, fan_out))
  if len(points) < config.min_points:
    return None, None, f"no skeleton ({len(points)} numbered points)"
  shared, suffixes = sot.expansion_inputs(tokenizer, question, skeleton, points, config.chat)
  if max(map(len, suffixes)) > script_width:
    return None, None, f"a point prompt of {max(map(len, suffixes))} tokens exceeds the server's {script_width}"
  # Spare threads end after one step: a thread's first script token is fed as its pending token, never read
  # as an end; the second, an end id chosen from the script, ends it
  scripts = list(suffixes) + [[end_id, end_id]] * (fan_out - len(points))
  return shared, scripts, Expansion(tuple(points), tuple(map(len, suffixes)))


def expansion_budget(config: sot.SotConfig, scripts) -> int:
  """Stage 2's new tokens, as `SkeletonOfThought` gives its expansion run."""
  return config.point_tokens + max(map(len, scripts))


def expansion_slots(ids, scripts, config: sot.SotConfig, lanes: int) -> int:
  """The pool `SkeletonOfThought` alone gives stage 2 (as `api.prepare` sizes a run with scripts): its room, not a
  per-point budget, is what ends the expansions, so a served row with less room would cut them shorter."""
  new = max(expansion_budget(config, scripts), sum(map(len, scripts)) + 2 * len(scripts))
  return loop.pool_size(bucket(len(ids)), new, lanes)
