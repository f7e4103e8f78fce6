"""Win rates: hand cases, and the length-controlled GLM against the `alpaca-eval` library on a fixed table."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn import model_selection as sklearn_model_selection  # dev dependencies: these checks always run

from pasta_jax.eval import winrate as W

# The libraries load their native code at collection, before any test starts XLA's thread pools: imported later,
# in a worker already running JAX, they crashed it (a segfault inside the import, or "failed to map segment").
with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  from alpaca_eval.metrics import glm_winrate

# A fixed annotation table: P(method beats baseline) per prompt, answer lengths in characters, and a
# per-instruction difficulty (for the library's fuller GLM variants). Preferences lean to the method
# and to the longer answer, so the GLM has something to correct.
P = [0.36, 0.69, 0.7, 0.15, 0.56, 0.54, 0.24, 0.87, 0.79, 0.89, 0.97, 0.36, 0.49, 0.89, 0.45, 0.58, 0.79, 0.3, 0.89,
     0.61, 0.63, 0.57, 0.67, 0.18]
METHOD_CHARS = [1107, 456, 1486, 723, 769, 806, 915, 874, 813, 1493, 1230, 1209, 1080, 971, 577, 1484, 752, 401, 1283,
                324, 1300, 957, 260, 161]
BASELINE_CHARS = [1422, 975, 1057, 1356, 909, 1185, 1267, 415, 177, 520, 499, 1322, 1377, 107, 799, 1249, 284, 1215,
                  266, 755, 1243, 524, 578, 489]
DIFFICULTY = [0.16, -0.19, -2.52, -0.54, -0.05, 0.11, -1.53, -0.48, -0.98, -0.81, 1.06, -0.81, -0.03, 0.88, -0.58,
              -0.11, 0.11, 0.06, -1.23, 0.08, 1.36, -1.55, 0.86, 0.12]
# Two "gamed" baselines' judgements (AlpacaEval's regularization rows for length_controlled_v1).
GAMED_P = [0.66, 0.13, 0.85, 0.94, 0.9, 0.57, 0.15, 0.19, 0.93, 0.55, 0.18, 0.88, 0.64, 0.57, 0.38, 0.41, 0.24, 0.04,
           0.88, 0.47, 0.55, 0.32, 0.75, 0.03, 0.37, 0.03, 0.12, 0.97, 0.66, 0.43, 0.52, 0.87, 0.34, 0.59, 0.68, 0.36,
           0.52, 0.77, 0.91, 0.15, 0.93, 0.01, 0.75, 0.81, 0.14, 0.42, 0.82, 0.01]
GAMED_STD_DELTA = [0.09, -0.59, -0.12, -2.0, -1.13, 0.36, -2.13, 0.85, -1.75, 0.76, -0.85, 0.78, 0.13, -1.54, 1.25,
                   1.44, -0.07, -0.27, -0.16, -0.98, 1.1, -0.54, -0.05, -0.79, -0.63, -1.28, 1.26, -0.15, 0.97, 0.01,
                   -0.69, -0.33, -0.56, 0.01, -0.38, -0.3, -1.38, -0.81, 1.65, -0.67, -1.05, 0.34, 1.41, -1.45,
                   -0.21, -0.63, -1.76, 0.73]
GAMED = W.GamedRows(np.array(GAMED_P), np.array(GAMED_STD_DELTA), np.array(DIFFICULTY * 2))

# liblinear stops at a relative tolerance of 1e-4 and we solve to 1e-10 (here: within 0.001 points). Where
# cross-validation scores of two penalties tie to ~1e-5 the two could pick different ones (~0.02 points).
LIBRARY_TOLERANCE = 0.01  # percentage points


def test_raw_win_rates_by_hand():
  rates = W.win_rates([1.0, 0.0, 0.5, 0.75, 0.75], [10] * 5, [10] * 5)
  assert rates.n == 5
  assert rates.win_rate == pytest.approx(60.0)  # mean P(win) = 3 / 5
  assert rates.discrete_win_rate == pytest.approx(70.0)  # wins 1, 0, tie 0.5, 1, 1
  assert rates.standard_error == pytest.approx(np.std([1, 0, 0.5, 0.75, 0.75], ddof=1) / math.sqrt(5) * 100)


@pytest.mark.parametrize("p", [[0.7] * 20, [0.9, 0.5] * 10, [0.3] * 20, [0.5] * 8])
def test_lc_at_equal_lengths_is_the_raw_win_rate(p):
  """With no length difference there is nothing to control for: LC equals the raw rate (70, 70, 30, 50),
  which a fit that ignored the judgements (always 50) or mis-signed the intercept would miss."""
  rates = W.win_rates(p, [100] * len(p), [100] * len(p))  # identical lengths: std of differences is 0
  assert rates.lc_win_rate == pytest.approx(rates.win_rate, abs=0.01)
  assert rates.win_rate == pytest.approx(100 * sum(p) / len(p))
  assert rates.lc_note == ""


def test_lc_needs_as_many_prompts_as_folds():
  rates = W.win_rates([0.9, 0.8, 0.7, 0.6], [1, 2, 3, 4], [4, 3, 2, 1])
  assert rates.win_rate == pytest.approx(75.0)
  assert math.isnan(rates.lc_win_rate) and "at least 5" in rates.lc_note


def test_lc_discounts_a_win_that_comes_from_length():
  # Mostly longer, and the judge prefers whichever answer is longer, as strongly either way: at equal
  # length there is no preference left (logit 0.8 = -logit 0.2), so LC is 50 while the raw rate is 65.
  ours = [300] * 15 + [100] * 5
  p = [0.8 if length > 200 else 0.2 for length in ours]
  rates = W.win_rates(p, ours, [200] * 20)
  assert rates.win_rate == pytest.approx(65.0)
  assert rates.lc_win_rate == pytest.approx(50.0, abs=0.5)


def test_group_folds_follow_sklearn_group_kfold():
  n = 13
  folds = np.zeros(n, int)
  for k, (_, test) in enumerate(sklearn_model_selection.GroupKFold(n_splits=5).split(np.zeros(n), groups=range(n))):
    folds[test] = k
  np.testing.assert_array_equal(W.group_folds(n, 5), folds)


@pytest.fixture(scope="module")
def alpaca_glm():
  """The library's GLM module, reading our gamed rows and difficulties instead of the hub's CSV."""
  return glm_winrate


def library_metrics(glm, spec: W.GlmSpec, tmp_path, monkeypatch) -> dict:
  n = len(P)
  gamed = pd.DataFrame({"model": ["gamed_a"] * n + ["gamed_b"] * n, "index": list(range(n)) * 2,
                        "instruction_difficulty": DIFFICULTY * 2, "preference": GAMED_P,
                        "std_delta_len": GAMED_STD_DELTA, "not_gamed_baseline": False})
  csv = tmp_path / "df_gamed.csv"
  gamed.to_csv(csv, index=False)
  monkeypatch.setattr(glm, "hf_hub_download", lambda **_: str(csv))  # the hub is not reachable offline
  annotations = pd.DataFrame({"preference": [1 + p for p in P],  # AlpacaEval: 1 = baseline wins, 2 = model
                              "output_1": ["b" * k for k in BASELINE_CHARS],
                              "output_2": ["m" * k for k in METHOD_CHARS],
                              "generator_1": "baseline", "generator_2": "method", "annotator": "fixed"})
  logging.disable(logging.WARNING)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return glm.get_length_controlled_winrate(annotations, glm_name=spec.name, save_weights_dir=None)
  finally:
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("spec", [W.LC_MINIMAL, W.LC_NOREG, W.LC_V1], ids=lambda s: s.name)
def test_lc_win_rate_matches_alpaca_eval(spec, alpaca_glm, tmp_path, monkeypatch):
  expected = library_metrics(alpaca_glm, spec, tmp_path, monkeypatch)
  ours = W.length_controlled_winrate(P, METHOD_CHARS, BASELINE_CHARS, difficulty=DIFFICULTY, gamed=GAMED, spec=spec)
  assert ours == pytest.approx(expected["length_controlled_winrate"], abs=LIBRARY_TOLERANCE)
  if spec == W.LC_MINIMAL:  # what `pasta eval` reports, raw rates included
    assert abs(ours - expected["win_rate"]) > 1  # the table's length bias is large enough to matter
    rates = W.win_rates(P, METHOD_CHARS, BASELINE_CHARS)
    assert rates.lc_win_rate == pytest.approx(ours)
    assert rates.win_rate == pytest.approx(expected["win_rate"])
    assert rates.discrete_win_rate == pytest.approx(expected["discrete_win_rate"])
    assert rates.standard_error == pytest.approx(expected["standard_error"])
