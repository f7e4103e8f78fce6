"""Tree speculation set-up for `generate(method="medusa" | "propd")`: heads, tree, calibration, latency.

A `Drafter` is a model's Medusa heads plus their calibrated top-k hit rates (what `train.medusa` writes
beside the heads). `rules_and_inputs` turns it into the decode core's `MedusaRules` and their read-only
`rule_inputs`; `decode.latency.calibrate_latency` measures ProPD's step-time table T(s) (`step_times`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.rules.medusa import MedusaRules
from pasta_jax.decode.rules.pasta_tree import PastaTreeRules
from pasta_jax.decode.rules.pruning import EarlyPrune, load_early_head
from pasta_jax.decode.tree import TokenTree, build_tree, default_hit_rates, node_probabilities
from pasta_jax.errors import PastaError
from pasta_jax.model import medusa

CALIBRATION_FILE = "calibration.json"
MEDUSA_DIR = "medusa"  # the shipped heads of an adapter live in <adapter>/medusa/
DEFAULT_TREE = 64  # Medusa's default tree size (its 63 candidates + the root)
FIXED_TREE = 16  # method "medusa"'s default: on a CPU a fixed 64-node tree costs more than it saves
THREAD_TREE = 4  # method "pasta+medusa"'s default: a tree on every live thread multiplies the rows of a step
# ProPD's largest tree in `pasta serve` (its --tree-size overrides): the server has no calibration run to size the
# compiled tree (`compiled_size`), and its online step-time model times every size of that tree at every rows
# bucket before it fits. On a 2-core CPU no size above 8 paid at batch 1 or 8 (bench.medusa: T(16) >= 1.8 T(1)),
# and one 64-node calibration chunk at batch 16 computes 1024 rows a step.
SERVED_PROPD_TREE = 8
# How much more often than on the calibration set a run's heads may hit before ProPD would take a tree: a tree
# that cannot pay even then is not compiled (`tree_pays`). At batch 8 on a 2-core CPU a 2-node step cost 1.7-2.0
# plain ones (bench.medusa), so it pays only when head 0 hits 70-100% of the time; the shipped heads' prior is 42%.
RATE_ROOM = 1.5
PROPD_PRUNE = EarlyPrune()  # ProPD's early pruning as the paper runs it: top 50 (layer: the trained head's)


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
  heads: dict
  config: medusa.MedusaConfig
  hit_rates: np.ndarray  # [H, k] calibrated: P(head h's rank-r token is right | its depth was reached)
  source: str = ""
  early_head: dict | None = None  # ProPD's trained early head (`train.medusa --stages early`); None: logit lens
  early_layer: int | None = None  # the layer the trained early head reads

  @property
  def top_k(self) -> int:
    return self.hit_rates.shape[1]

  def tree(self, size: int) -> TokenTree:
    """Medusa's recipe: the greedy tree of `size` nodes for these heads' calibrated hit rates."""
    return build_tree(self.hit_rates, size)


def load_drafter(model, heads=None) -> Drafter:
  """The Medusa heads for `model`: a `Drafter`, a folder `train.medusa` wrote, or None for the ones shipped
  with the model (its adapter folder's `medusa/`)."""
  if isinstance(heads, Drafter):
    return heads
  folder = Path(heads) if heads is not None else Path(str(model.source)) / MEDUSA_DIR
  if not (folder / medusa.CONFIG_FILE).exists():
    raise PastaError(f"no Medusa heads for {model.source} (looked in {folder}); train them with "
                     "`python -m train.medusa --out DIR` and pass heads=DIR/heads")
  params, config, meta = medusa.load_heads(folder)
  calibration = folder / CALIBRATION_FILE
  if calibration.exists():
    rates = np.asarray(json.loads(calibration.read_text())["hit_rates"], np.float32)
  else:
    rates = default_hit_rates(config.num_heads, 8).astype(np.float32)
  early_head, early_layer = load_early_head(folder) or (None, None)
  return Drafter(params, config, rates, str(folder), early_head, early_layer)


def early_prune(dynamic: bool, prune, drafter: Drafter) -> EarlyPrune | None:
  """The early pruning a tree method runs. None -> the method's default: ProPD prunes at its trained early head's
  layer (top 50, as the paper) when the heads have one, else not (the untrained logit lens is useless on a shallow
  layer); Medusa does not prune (the paper adds it in ProPD). False -> none. An `EarlyPrune` -> as given, at the
  trained head's layer if there is one."""
  if prune is None:
    if not dynamic or drafter.early_head is None:
      return None
    return dataclasses.replace(PROPD_PRUNE, layer=drafter.early_layer)
  if prune is False:
    return None
  if not isinstance(prune, EarlyPrune):
    raise PastaError(f"prune must be None (the method's default), False or an EarlyPrune, got {prune!r}")
  if drafter.early_head is not None and prune.layer != drafter.early_layer:
    raise PastaError(f"the early head in {drafter.source} reads layer {drafter.early_layer}, not {prune.layer}")
  return prune


def rules_and_inputs(drafter: Drafter, *, tree_size: int = DEFAULT_TREE, dynamic: bool = False,
                     acceptance: str = "greedy", latency=None, choices=None,
                     prune: EarlyPrune | None = None) -> tuple[MedusaRules, dict]:
  """(MedusaRules, rule_inputs) for a tree of `tree_size` nodes (or an explicit Medusa `choices` list);
  dynamic=True (ProPD) takes `latency`: (alpha, beta) of T(s) = alpha s + beta, or {size: seconds per step};
  prune: ProPD's early pruning (with the drafter's trained early head, else the logit lens)."""
  tree = TokenTree.from_choices(choices) if choices is not None else drafter.tree(tree_size)
  rules = MedusaRules(tree=tree, num_heads=drafter.config.num_heads, top_k=drafter.top_k, acceptance=acceptance,
                      dynamic=dynamic, prune=prune)
  inputs = {"heads": drafter.heads, "rates": jnp.asarray(drafter.hit_rates, jnp.float32)}
  if prune is not None and drafter.early_head is not None:
    inputs["early"] = {k: jnp.asarray(v, jnp.float32) for k, v in drafter.early_head.items()}
  if dynamic:
    if latency is None:
      raise PastaError("method='propd' needs a latency model: latency=(alpha, beta) seconds, or per-size times "
                       "(`calibrate_latency`)")
    inputs["latency"] = jnp.asarray(latency_table(latency, rules.sizes), jnp.float32)
  return rules, inputs


def pasta_tree_rules(drafter: Drafter, *, tree_size: int = THREAD_TREE, thread_lanes: int = 8, threads: int = 64,
                     choices=None, softcap: float | None = None) -> tuple[PastaTreeRules, dict]:
  """(PastaTreeRules, rule_inputs): PASTA on `thread_lanes` lanes, each live thread with a `tree_size`-node tree."""
  tree = TokenTree.from_choices(choices) if choices is not None else drafter.tree(tree_size)
  rules = PastaTreeRules(tree=tree, thread_lanes=thread_lanes, threads=threads, num_heads=drafter.config.num_heads,
                         top_k=drafter.top_k, softcap=softcap)
  return rules, {"heads": drafter.heads}


def latency_table(latency, sizes) -> np.ndarray:
  """Seconds per step at each size: from (alpha, beta) of T(s) = alpha s + beta, or a {size: seconds} table."""
  if isinstance(latency, dict):
    missing = [s for s in sizes if s not in latency]
    if missing:
      raise PastaError(f"the latency table has no step time for tree sizes {missing}")
    values = np.asarray([latency[s] for s in sizes], np.float64)
  else:
    alpha_beta = np.asarray(latency, np.float64)
    if alpha_beta.shape != (2,):
      raise PastaError(f"latency must be (alpha, beta) seconds or a {{size: seconds}} table, got {latency!r}")
    values = alpha_beta[0] * np.asarray(sizes, np.float64) + alpha_beta[1]
  if np.any(values <= 0):
    raise PastaError(f"step times must be positive, got {values}")
  return values


def paying_size(tree: TokenTree, table: dict[int, float]) -> int:
  """The largest size in ProPD's step-time `table` ({size: seconds}, size 1 included) that can beat a plain step:
  a prefix of s nodes of `tree` accepts at most its depth + 1 tokens a step, so a size with T(s) >= (depth + 1)
  T(1) never wins, whatever the hit rates. ProPD should compile its tree only up to that size (at least 2 nodes):
  every lane of the compiled tree costs bookkeeping on every tree step (a step where no request plans a tree is
  plain decoding's, whatever the tree: `MedusaRules.cheaper_steps`)."""
  depth = tree.depth
  paying = [s for s, t in table.items() if 1 < s <= tree.size and t < (depth[:s].max() + 1) * table[1]]
  return max(paying, default=min(tree.size, 2))


def accepted_needed(tree: TokenTree, table: dict[int, float], ratio: float = 1.0) -> dict[int, float]:
  """{size: tokens a step of that size must write on average to run `ratio` times as fast as plain decoding} for
  the tree sizes of ProPD's step-time `table` ({size: seconds}, size 1 included): ratio T(s) / T(1). A size whose
  need exceeds its prefix's depth + 1 (the most a step can write) cannot reach `ratio` whatever the drafter; at
  size 2 the need less 1 is the share of steps on which head 0's first guess must be right."""
  return {s: ratio * t / table[1] for s, t in sorted(table.items()) if 1 < s <= tree.size}


def tree_pays(tree: TokenTree, table: dict[int, float], hit_rates: np.ndarray, room: float = RATE_ROOM) -> bool:
  """Whether ProPD could ever pick a tree of `tree`'s prefixes over a plain step: some size s > 1 in its step-time
  `table` whose expected tokens over T(s) beat 1 / T(1) at hit rates `room` times the calibrated `hit_rates`
  (capped at 1): heads hitting that much more often than on the calibration set. When none can, ProPD's choice is
  size 1 on every step, which is plain decoding: it then runs plain decoding's program (`methods.Propd.layout`), with
  no tree step and no probe (ProPD's own program takes plain decoding's step while it plans no tree, but its first
  step is a tree step and head 0 runs on its probe steps)."""
  optimistic = np.minimum(np.asarray(hit_rates, np.float64) * room, 1.0)
  expected = np.cumsum(node_probabilities(tree, optimistic))  # [N] E(prefix of i + 1 nodes)
  return any(expected[s - 1] / t > 1.0 / table[1] for s, t in table.items() if 1 < s <= tree.size)


def compiled_size(tree: TokenTree, table: dict[int, float], hit_rates: np.ndarray) -> int:
  """The tree ProPD compiles: up to twice the size its calibrated prior would choose (one lane bucket of room
  for a run whose heads hit more often than the calibration set's), never past the sizes that can pay
  (`paying_size`), at least 2 nodes. A lane compiled and never used still costs bookkeeping every tree step (at
  batch 1 on a 2-core CPU, a 64-node ProPD ran 3% slower than a fixed 4-node tree choosing the same size)."""
  expected = np.cumsum(node_probabilities(tree, hit_rates))  # [N] E(prefix of i + 1 nodes)
  best = max((s for s in table if s <= tree.size), key=lambda s: expected[s - 1] / table[s])
  return max(min(tree.size, 2), min(paying_size(tree, table), 2 * best))


def fit_latency(sizes, seconds) -> tuple[float, float]:
  """Least-squares (alpha, beta) of T(s) = alpha s + beta (alpha >= 0, beta > 0)."""
  a, b = np.polyfit(np.asarray(sizes, np.float64), np.asarray(seconds, np.float64), 1)
  return max(float(a), 0.0), max(float(b), 1e-6)


LATENCY_MODELS = ("buckets", "line")


def check_latency_model(model: str) -> None:
  """Refuses a step-time model `step_times` does not know (callers check before minutes of timing)."""
  if model not in LATENCY_MODELS:
    raise PastaError(f"the step-time model must be one of {LATENCY_MODELS}, got {model!r}")


def step_times(sizes, seconds, model: str = "buckets") -> tuple[dict[int, float], tuple[float, float]]:
  """ProPD's step-time table from the per-step seconds measured at each size, and the (alpha, beta) of the paper's
  T(s) = alpha s + beta fitted over the tree sizes alone (reported either way; the heads' cost is a step in T
  between 1 and 2, which a line through the plain step would smear over every size).

  model="buckets" (the default): every size keeps its own measurement. ProPD's sizes are the step driver's lane
  buckets, each a compiled branch of its own, so T is a step function measured at every point ProPD can choose,
  and on a CPU it is no line: 1 and 2 rows read the same weights (memory-bound), and the measured head plan runs
  the int8 head at some buckets (2-3 or 2-4 rows) and the float32 one at the others. bench.medusa at batch 1 on a
  2-core EPYC (2026-11-28) measured T(1, 2, 4, 8) = 43.6, 41.2, 55.2, 64.2 ms, where the line through the tree
  sizes gives T(4) = 51.1 (7% low): ProPD took 4-node trees on 135 of 196 steps and ran 1.256x plain against the
  fixed 2-node tree's 1.403x.
  model="line": size 1 as measured, the tree sizes from the line (the paper's model; smoother where the step
  times are noisy and close to a line)."""
  check_latency_model(model)
  measured = dict(zip((int(s) for s in sizes), (float(t) for t in seconds), strict=True))
  trees = {s: t for s, t in measured.items() if s > 1}
  if len(trees) < 2:  # too few tree sizes to fit a line through: the measurements are the table
    return measured, fit_latency(list(measured), list(measured.values())) if len(measured) > 1 else (0.0, seconds[0])
  alpha, beta = fit_latency(list(trees), list(trees.values()))
  if model == "buckets":
    return measured, (alpha, beta)
  return {s: measured[s] if s == 1 else alpha * s + beta for s in measured}, (alpha, beta)
