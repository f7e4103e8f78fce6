"""bench.step_buckets: per-step cost by rows a step, fitted over a run's answers."""

import numpy as np

from bench.step_buckets import fit, parsed_answers, step_counts
from tests.lang_helpers import CHARS, VOCAB


def test_the_fit_recovers_the_costs_behind_synthetic_answers():
  rng = np.random.default_rng(0)
  costs, fixed = np.array([0.050, 0.052, 0.071, 0.075, 0.150]), 0.1  # baseline 1 row, method 1, 2, 3-4, 5-8 rows
  answers = []
  for i in range(60):
    baseline = i % 2 == 0
    rest = [0, 0, 0] if baseline else [int(n) for n in rng.integers(0, 40, 3)]
    counts = [int(rng.integers(20, 200)), *rest]
    columns = [counts[0] if baseline else 0, 0 if baseline else counts[0], *counts[1:]]
    answers.append((baseline, counts, fixed + float(np.dot(costs, columns))))
  got_fixed, got, steps = fit(answers)
  np.testing.assert_allclose(got, costs, rtol=1e-6)
  assert abs(got_fixed - fixed) < 1e-6
  assert steps[0] == sum(a[1][0] for a in answers if a[0])  # the baseline's one-row steps, its own column


def test_steps_are_counted_by_the_rows_they_feed():
  # main: "Hi " and the promise's 4 tokens at steps 1-7; the fork feeds <async> beside the length token (step 7),
  # "x" beside main's "!" (8), "y" alone (9), </async> beside <sync/> (10); "." at 11: 8 one-row steps, 3 of 2 rows
  text = 'Hi <promise topic="ab" tokens="20"/><async>xy</async>!<sync/>.'
  assert step_counts(text, CHARS, VOCAB) == [8, 3, 0, 0]


def test_answers_whose_tags_do_not_parse_are_left_out_and_counted():
  good = 'Hi <promise topic="ab" tokens="20"/><async>xy</async>!<sync/>.'
  runs = [{"method": "sequential:b", "output": {"annotated": "Hi there.", "seconds": 1.0}},
          {"method": "pasta:m", "output": {"annotated": good, "seconds": 2.0}},
          {"method": "pasta:m", "output": {"annotated": "Hi <async>xy</async>.", "seconds": 3.0}}]  # no promise
  answers, malformed = parsed_answers(runs, CHARS, VOCAB)
  assert malformed == 1
  assert answers == [(True, step_counts("Hi there.", CHARS, VOCAB), 1.0), (False, [8, 3, 0, 0], 2.0)]
