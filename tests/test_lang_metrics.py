"""Critical path and speed metrics: hand-computed step schedules, bounds over random programs, and
agreement with the steps the jitted interpreter actually runs."""

import math

import numpy as np
import pytest
from hypothesis import given, settings

from pasta_jax.lang import metrics as M
from pasta_jax.lang.tokens import TokBlock, parse_tokens
from tests.lang_helpers import EOS, HAND_ANSWER, VOCAB, a, b, replay, token_programs, x, y

V = VOCAB
L10 = V.length_token(10)


def block(*content):
  return [V.async_open, *content, V.async_close]


def test_plain_answer_critical_path_is_its_length():
  for n in range(5):
    assert M.critical_path([a] * n, V) == n
    assert M.critical_path([a] * n + [EOS], V) == n  # the final end id is sampled, never fed
  metrics = M.answer_metrics([a, b, a], V)
  assert metrics == M.AnswerMetrics(critical_path=3, content_tokens=3, answer_tokens=3, num_blocks=0)
  assert metrics.theoretical_speedup() == 1.0 and metrics.theoretical_parallelism == 1.0


def test_one_block_then_sync():
  # a P t L [<async> x y </async>] <sync/> b
  ids = [a, V.promise, a, L10] + block(x, y) + [V.sync, b]
  steps, path = M.feed_steps(ids, V)
  # a:1 P:2 t:3 L:4 spawns <async>:4 (same step), x:5 y:6, </async>:7 (closing step); <sync/> waits for the
  # closing fork and feeds in that same step 7; b:8.
  assert steps == [1, 2, 3, 4, 4, 5, 6, 7, 7, 8]
  assert path == 8
  assert M.answer_metrics(ids, V).content_tokens == 4  # a x y b: no tags, no topic
  assert M.theoretical_speedup(ids, V) == 4 / 8
  assert M.theoretical_speedup(ids, V, baseline_tokens=12) == 12 / 8


def test_sync_waits_for_the_longest_fork():
  ids = [V.promise, L10] + block(*[x] * 10) + [V.promise, L10] + block(*[y] * 10) + [V.sync]
  # P:1 L:2 -> fork 1 closes at 2 + 10 + 1 = 13; P:3 L:4 -> fork 2 closes at 15; <sync/> at max(5, 13, 15).
  assert M.critical_path(ids, V) == 15
  assert M.theoretical_speedup(ids, V) == 20 / 15
  assert M.answer_metrics(ids, V).num_blocks == 2


def test_end_is_an_implicit_final_sync():
  ids = [a, V.promise, L10] + block(x, x, x)  # a:1 P:2 L:3; the fork feeds </async> at 3 + 3 + 1
  assert M.critical_path(ids, V) == 7
  ids_long_main = [V.promise, L10] + block(x) + [b] * 6  # fork closes at 2 + 1 + 1 = 4; main ends at 8
  assert M.critical_path(ids_long_main, V) == 8


def test_sync_with_no_forks_costs_one_step():
  assert M.feed_steps([V.sync, a, V.sync], V) == ([1, 2, 3], 3)


def test_hand_answer():
  # a:1 P:2 t:3 L10:4 [fork 1 closes 6]; b:5 P:6 L20:7 [fork 2: y:8 z:9 closes 10]; S: max(8, 6, 10) = 10;
  # c:11 P:12 L10:13 [fork 3: w:14 closes 15]; d:14; end: max(14, 15) = 15.
  metrics = M.answer_metrics(HAND_ANSWER, V)
  assert metrics == M.AnswerMetrics(critical_path=15, content_tokens=8, answer_tokens=22, num_blocks=3)
  assert metrics.theoretical_parallelism == 8 / 15


def test_empty_answer():
  metrics = M.answer_metrics([EOS], V)
  assert metrics.critical_path == 0 and metrics.content_tokens == 0
  assert metrics.theoretical_speedup() == 0.0


@given(token_programs(max_items=8))
@settings(max_examples=150, deadline=None)
def test_critical_path_bounds(ids):
  """Main's own tokens feed one per step (lower bound); feeding every token one after the other (each
  <async> in its LENGTH's step) is a valid schedule the parallel one never loses to (upper bound)."""
  segments = parse_tokens(ids, V)
  blocks = [s for s in segments if isinstance(s, TokBlock)]
  main_tokens = len(ids) - sum(len(s.all_ids) for s in blocks)
  path = M.critical_path(ids, V)
  assert main_tokens <= path <= len(ids) - len(blocks)
  steps, _ = M.feed_steps(ids, V)
  assert max(steps, default=0) == path


def test_means():
  assert M.geometric_mean([1, 4]) == pytest.approx(2.0)
  assert M.geometric_mean([2.0]) == pytest.approx(2.0)
  assert M.arithmetic_mean([1, 4]) == 2.5
  assert math.isnan(M.geometric_mean([])) and math.isnan(M.arithmetic_mean([]))
  with pytest.raises(ValueError, match="positive"):
    M.geometric_mean([1.0, 0.0])


# --- interpreter traces -----------------------------------------------------------------------------------
def test_critical_path_equals_interpreter_steps():
  """With enough lanes the interpreter runs exactly critical_path steps; the trace helpers rebuild the
  answer and the step count from the records alone."""
  _, answers, outputs = replay("pred")
  for answer, out in zip(answers, outputs, strict=True):
    assert out.finished and out.stalls == 0
    assert out.steps == M.critical_path(answer, V), answer
    assert M.annotated_from_records(out.records, V) == answer + [EOS]
    assert M.trace_steps(out.records, V) == out.steps
    trace = M.trace_metrics(out.records, V)
    assert trace.answer == M.answer_metrics(answer, V) and trace.steps == out.steps


def test_trace_with_stalls():
  """One fork lane: promises stall until the lane frees, so the run takes at least the critical path."""
  _, answers, outputs = replay("pred", lanes=2)
  stalled = 0
  for answer, out in zip(answers, outputs, strict=True):
    assert out.finished
    assert out.steps >= M.critical_path(answer, V)
    assert M.trace_steps(out.records, V) == out.steps
    assert M.annotated_from_records(out.records, V) == answer + [EOS]
    stalled += out.stalls > 0
    metrics = M.trace_metrics(out.records, V, steps=out.steps)
    assert metrics.realized_step_speedup() <= metrics.answer.theoretical_speedup() + 1e-9
  assert stalled > 0


def test_a_cut_leaves_forks_open_and_close_open_closes_each():
  """Records of a run cut with two forks still writing (threads 1 and 2) and main mid-text: only `close_open`
  gives each open fork its `</async>`, in place, and the answer then parses."""
  P = V.promise
  rows = [(0, 0, 0, t, 0) for t in (x, P, a, L10)] + [(0, 1, 1, V.async_open, 0), (0, 1, 1, y, 0)] + \
         [(0, 0, 0, t, 0) for t in (P, b, L10)] + [(0, 2, 2, V.async_open, 0), (0, 2, 2, x, 0), (0, 0, 0, y, 0)]
  records = np.asarray(rows, np.int32)
  cut = M.annotated_from_records(records, V)
  assert cut == [x, P, a, L10, V.async_open, y, P, b, L10, V.async_open, x, y]
  closed = M.annotated_from_records(records, V, close_open=True)
  assert closed == [x, P, a, L10, V.async_open, y, V.async_close, P, b, L10, V.async_open, x, V.async_close, y]
  assert M.answer_metrics(closed, V).content_tokens == 4
