"""Win rates from pairwise judgements: the raw win rate and AlpacaEval's length-controlled (LC) win rate.

A judgement is P(method's answer beats the baseline's), from `judges.base.judge_both_orders`.

The LC win rate is AlpacaEval 2's GLM (`alpaca_eval.metrics.glm_winrate.get_length_controlled_winrate`,
package version 0.6.6), reimplemented with numpy so `pasta eval` does not need the package (nor
its `setuptools<81` pin) at run time; `tests/test_eval_winrate.py` checks it against the library. The
GLM, per prompt i with p_i = P(method wins):
  std_delta_len_i = (len(baseline_i) - len(method_i)) / std(those differences)   (characters, ddof=1)
  logit P(method wins) = a * tanh(std_delta_len_i) [+ b * difficulty_i] + c * not_gamed_i
fit on soft labels p_i by L1-penalized logistic regression without intercept (the library's sklearn
liblinear call), its penalty chosen by 5-fold cross-validation (prompts grouped as sklearn's
`GroupKFold` groups them) over C in logspace(-4, 4, 10) by log loss, then refit on every prompt. The
LC win rate is the mean prediction with the length difference set to zero.

Variants (the library's names):
  length_controlled_minimal  no difficulty, no regularization rows  (what `pasta eval` uses)
  length_controlled_noreg    + per-instruction difficulty
  length_controlled_v1       + difficulty + AlpacaEval's "gamed" baseline rows weighted lambda/2
                              (AlpacaEval's default for its leaderboard)
`pasta eval` uses the minimal variant because the difficulty table and the gamed rows are AlpacaEval
hub data for its GPT-4 annotator and its 805 prompts (not reachable offline, and meaningless for
MT-Bench, other files, our judges and our baselines). With neither, the LC win rate is the logistic of
the fitted intercept: the win rate the GLM expects at equal lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

LOG_LOSS_CLIP = 1e-15  # the library's clip of predicted probabilities in its CV log loss


@dataclasses.dataclass(frozen=True)
class GlmSpec:
  name: str
  use_difficulty: bool
  regularize_to_baseline_lambda: float | None  # weight of the gamed rows (halved: two gamed baselines)
  n_splits: int = 5
  cs: tuple[float, ...] = tuple(float(c) for c in np.logspace(-4, 4, 10))  # LogisticRegressionCV(Cs=10)


LC_MINIMAL = GlmSpec("length_controlled_minimal", use_difficulty=False, regularize_to_baseline_lambda=None)
LC_NOREG = GlmSpec("length_controlled_noreg", use_difficulty=True, regularize_to_baseline_lambda=None)
LC_V1 = GlmSpec("length_controlled_v1", use_difficulty=True, regularize_to_baseline_lambda=0.2)


@dataclasses.dataclass(frozen=True)
class GamedRows:
  """AlpacaEval's regularization rows (`df_gamed.csv`): judgements of length-gamed baselines."""

  preference: np.ndarray  # in [0, 1], as the library stores them
  std_delta_len: np.ndarray  # already standardized
  difficulty: np.ndarray


@dataclasses.dataclass(frozen=True)
class WinRates:
  n: int  # judged prompts
  win_rate: float  # percent: mean P(method wins)
  standard_error: float  # percent (sem, ddof=1)
  discrete_win_rate: float  # percent: wins count 1, ties 1/2
  lc_win_rate: float  # percent; nan when unavailable (see lc_note)
  lc_note: str = ""


def win_rates(p_method: Sequence[float], method_chars: Sequence[int], baseline_chars: Sequence[int],
              spec: GlmSpec = LC_MINIMAL) -> WinRates:
  """Raw and length-controlled win rates of a method against its baseline (lengths in characters)."""
  p = np.asarray(p_method, float)
  n = len(p)
  if n == 0:
    return WinRates(0, math.nan, math.nan, math.nan, math.nan, "no judged prompts")
  discrete = np.where(p == 0.5, 0.5, (p > 0.5).astype(float))  # the library's exact-tie test
  sem = float(np.std(p, ddof=1) / math.sqrt(n)) * 100 if n > 1 else math.nan
  lc, note = math.nan, f"needs at least {spec.n_splits} judged prompts (got {n})"
  if n >= spec.n_splits:
    lc, note = length_controlled_winrate(p, method_chars, baseline_chars, spec=spec), ""
  return WinRates(n, float(p.mean()) * 100, sem, float(discrete.mean()) * 100, lc, note)


def length_controlled_winrate(p_method: Sequence[float], method_chars: Sequence[int],
                              baseline_chars: Sequence[int], *, difficulty: Sequence[float] | None = None,
                              gamed: GamedRows | None = None, spec: GlmSpec = LC_MINIMAL) -> float:
  """AlpacaEval's LC win rate in percent (see the module doc). `difficulty` and `gamed` as the spec needs."""
  p = np.asarray(p_method, float)
  if spec.use_difficulty and difficulty is None:
    raise ValueError(f"{spec.name} needs the per-prompt instruction difficulty")
  if spec.regularize_to_baseline_lambda and gamed is None:
    raise ValueError(f"{spec.name} needs AlpacaEval's gamed-baseline rows")
  delta = np.asarray(baseline_chars, float) - np.asarray(method_chars, float)
  real = design(std_delta_len(delta), difficulty, not_gamed=1.0, spec=spec)
  x, labels, weights = real, p, np.ones(len(p))
  if spec.regularize_to_baseline_lambda:  # gamed rows first, as the library concatenates them
    fake = design(gamed.std_delta_len, gamed.difficulty, not_gamed=0.0, spec=spec)
    x = np.concatenate([fake, real])
    labels = np.concatenate([gamed.preference, p])
    weights = np.concatenate([np.full(len(fake), spec.regularize_to_baseline_lambda / 2), weights])
  known = ~np.isnan(labels)  # the library fits on judged rows only, and predicts for every prompt
  coef = fit_cv(x[known], labels[known], weights[known], spec)
  at_equal_length = design(np.zeros(len(p)), difficulty, not_gamed=1.0, spec=spec)
  return float(sigmoid(at_equal_length @ coef).mean()) * 100


def std_delta_len(delta: np.ndarray) -> np.ndarray:
  """Length differences over their standard deviation; all zeros when they do not vary (the library
  would divide by zero there: with no length difference there is nothing to control for)."""
  spread = float(np.std(delta, ddof=1)) if len(delta) > 1 else 0.0
  return delta / spread if spread > 0 else np.zeros_like(delta)


def design(std_delta: np.ndarray, difficulty, *, not_gamed: float, spec: GlmSpec) -> np.ndarray:
  """Design matrix: tanh(std_delta_len), [difficulty], not_gamed_baseline (the library's column order)."""
  columns = [np.tanh(np.asarray(std_delta, float))]
  if spec.use_difficulty:
    columns.append(np.asarray(difficulty, float))
  columns.append(np.full(len(columns[0]), not_gamed))
  return np.stack(columns, axis=1)


def sigmoid(z: np.ndarray) -> np.ndarray:
  return np.exp(-np.logaddexp(0.0, -z))


# --- the fit: L1 logistic regression on soft labels, C by grouped cross-validation --------------------
def fit_cv(x: np.ndarray, p: np.ndarray, weights: np.ndarray, spec: GlmSpec) -> np.ndarray:
  """LogisticRegressionCV(penalty='l1', fit_intercept=False, cv=GroupKFold) on soft labels; returns coef."""
  folds = group_folds(len(p), spec.n_splits)
  scores = np.zeros(len(spec.cs))
  for fold in range(spec.n_splits):
    train, test = folds != fold, folds == fold
    for k, c in enumerate(spec.cs):
      coef = fit_l1_logistic(x[train], p[train], weights[train], c)
      scores[k] -= cv_log_loss(x[test] @ coef, p[test], weights[test])
  best = int(np.argmax(scores))  # the first best on ties, as numpy's argmax in sklearn
  return fit_l1_logistic(x, p, weights, spec.cs[best])


def group_folds(n: int, n_splits: int) -> np.ndarray:
  """Fold of each row under sklearn's GroupKFold with one group per row (equal sizes): the last row
  goes to fold 0, the one before to fold 1, and so on round-robin."""
  return (n - 1 - np.arange(n)) % n_splits


def cv_log_loss(z: np.ndarray, p: np.ndarray, weights: np.ndarray) -> float:
  """The library's scorer: mean over rows of weight * soft-label cross-entropy, probabilities clipped."""
  q = np.clip(sigmoid(z), LOG_LOSS_CLIP, 1 - LOG_LOSS_CLIP)
  return float(-np.mean(weights * (p * np.log(q) + (1 - p) * np.log(1 - q))))


def fit_l1_logistic(x: np.ndarray, p: np.ndarray, weights: np.ndarray, c: float, tol: float = 1e-10,
                    max_iter: int = 100) -> np.ndarray:
  """argmin_w ||w||_1 + C * sum_i weights_i * CE(p_i, sigmoid(x_i . w)): liblinear's L1 objective with
  the library's soft labels (each row duplicated as a 1 weighted p and a 0 weighted 1 - p).

  Proximal Newton (liblinear's newGLMNET, with few features), run to a tight tolerance rather than
  liblinear's 1e-4: each step minimizes the L1 term plus the loss's quadratic model by coordinate
  descent, then backtracks until the objective falls enough.
  """
  coef = np.zeros(x.shape[1])
  first = None
  for _ in range(max_iter):
    s = sigmoid(x @ coef)
    grad = c * (x.T @ (weights * (s - p)))
    norm = min_norm_subgradient(coef, grad)
    first = norm if first is None else first
    if norm <= tol * max(first, 1.0):
      break
    hess = c * (x.T * (weights * s * (1 - s))) @ x
    coef = line_search(x, p, weights, c, coef, grad, l1_quadratic_step(coef, grad, hess))
  return coef


def l1_objective(x, p, weights, c, coef) -> float:
  z = x @ coef
  return float(np.abs(coef).sum() + c * np.sum(weights * (np.logaddexp(0.0, z) - p * z)))


def min_norm_subgradient(coef: np.ndarray, grad: np.ndarray) -> float:
  """Size of the smallest subgradient of the objective: zero exactly at the optimum."""
  at_zero = np.maximum(np.abs(grad) - 1.0, 0.0)
  return float(np.max(np.where(coef != 0, np.abs(grad + np.sign(coef)), at_zero)))


def l1_quadratic_step(coef, grad, hess, sweeps: int = 200) -> np.ndarray:
  """argmin_d grad.d + d.H.d / 2 + ||coef + d||_1 by coordinate descent (soft-thresholding)."""
  step = np.zeros_like(coef)
  for _ in range(sweeps):
    largest_change = 0.0
    for j in range(len(coef)):
      if hess[j, j] <= 1e-300:  # a feature that is zero on every row: its weight stays 0
        new = -coef[j]
      else:
        slope = grad[j] + hess[j] @ step - hess[j, j] * step[j]
        target = coef[j] - slope / hess[j, j]
        new = np.sign(target) * max(abs(target) - 1.0 / hess[j, j], 0.0) - coef[j]
      largest_change = max(largest_change, abs(new - step[j]))
      step[j] = new
    if largest_change <= 1e-15 * max(1.0, np.abs(coef).max()):
      break
  return step


def line_search(x, p, weights, c, coef, grad, step, shrink: float = 0.5, sufficient: float = 0.01) -> np.ndarray:
  """Backtracks along `step` until the objective decreases by a fraction of the model's prediction."""
  before = l1_objective(x, p, weights, c, coef)
  predicted = grad @ step + np.abs(coef + step).sum() - np.abs(coef).sum()
  t = 1.0
  for _ in range(60):
    trial = coef + t * step
    if l1_objective(x, p, weights, c, trial) <= before + sufficient * t * predicted:
      return trial
    t *= shrink
  return coef
