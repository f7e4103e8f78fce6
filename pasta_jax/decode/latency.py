"""ProPD's step-time model, measured: T(s) at each tree size ProPD may pick, on this device and batch size.

The decode loop runs on device, so step times are taken between host calls: the ProPD program itself runs
with its tree size pinned to each candidate size in turn (a latency table of 1 at that size and 1e9
elsewhere: one compiled program serves every size). Each size keeps its measured time (the sizes are the step
driver's lane buckets, each its own compiled branch), and the paper's T(s) = alpha s + beta is fitted over the tree
sizes by least squares, reported, and the table with `latency_model="line"` (`speculation.step_times`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pasta_jax.decode import api
from pasta_jax.decode.speculation import (
    DEFAULT_TREE,
    Drafter,
    check_latency_model,
    compiled_size,
    early_prune,
    rules_and_inputs,
    step_times,
    tree_pays,
)


def calibrate_latency(model, ids, drafter: Drafter, *, tree_size: int = DEFAULT_TREE, steps: int = 16,
                      repeats: int = 2, run_tokens: int | None = None, latency_model: str = "buckets",
                      prune=None, **prepare_kw) -> dict:
  """Times the ProPD loop with its size pinned to each candidate size (latency 1 there, 1e9 elsewhere: the
  same compiled program) on `ids` (the batch size matters); returns sizes, per-step seconds, the fit of the
  tree sizes, the table ProPD takes (`latency=...["table"]`) and the tree size to compile ProPD with
  (`tree_size=...["tree_size"]`: `speculation.compiled_size`, at most the largest size that can pay). A step's
  time is the difference of a run of 2 x `steps` tokens and one of `steps` over their step counts, so the
  prefill both include cancels out. run_tokens: the max_new_tokens of the run being calibrated: the steps are
  timed in the pool it will have (a step's cost grows with the pool: at batch 8 on a 2-core CPU a plain step cost
  81 ms in a 128-slot pool and 89 ms in a 256-slot one). latency_model: `speculation.step_times`' model.

  When that is fewer nodes than `tree_size`, the sizes that remain are timed again in the program of that
  smaller tree, the one ProPD then runs: every compiled lane costs bookkeeping on every tree step, so the big
  program's times overstate a small step's and understate what a tree adds to it (at batch 8 on a 2-core CPU,
  a size-1 step of the 64-node program cost 1.21x plain, of an 8-node one 0.96x). `first_pass` keeps the
  big program's figures. When no tree of that program can pay even with heads hitting `speculation.RATE_ROOM`
  times as often as on the calibration set (`speculation.tree_pays`, on the final table), "tree_size" is 1: ProPD
  then picks size 1 on every step, and runs as plain decoding ("tree_pays": False); "timed_tree" is the tree whose
  program the table was timed in. The second pass's times are capped by the first's (`cap_by_bigger_program`;
  "capped": the sizes whose time was)."""
  check_latency_model(latency_model)  # before minutes of timing, not after
  prepare_kw = {**prepare_kw, "pool_tokens": max(run_tokens or 0, 2 * steps)}
  pruning = early_prune(True, prune, drafter)  # ProPD's (`Propd.prune`): timed as it will run
  sizes, per_step = _time_sizes(model, ids, drafter, tree_size, steps, repeats, pruning, prepare_kw)
  table, (alpha, beta) = step_times(sizes, per_step, latency_model)
  compiled = compiled_size(drafter.tree(tree_size), table, drafter.hit_rates)  # the tree rules_and_inputs builds
  first_pass, capped = None, []
  if compiled < tree_size:
    first_pass = {"tree_size": tree_size, "sizes": sizes, "seconds": per_step, "table": table}
    sizes, measured = _time_sizes(model, ids, drafter, compiled, steps, repeats, pruning, prepare_kw)
    per_step, capped = cap_by_bigger_program(sizes, measured, first_pass)
    table, (alpha, beta) = step_times(sizes, per_step, latency_model)
  pays = tree_pays(drafter.tree(compiled), table, drafter.hit_rates)
  return {"sizes": sizes, "seconds": per_step, "alpha": alpha, "beta": beta, "table": table,
          "latency_model": latency_model, "tree_size": compiled if pays else 1, "timed_tree": compiled,
          "tree_pays": pays, "first_pass": first_pass, "capped": capped,
          "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def cap_by_bigger_program(sizes, seconds, first_pass: dict) -> tuple[list[float], list[int]]:
  """(seconds per step at each size, the sizes capped): a smaller tree's program times each size at most at the
  bigger program's time for it, since its step does the same rows with fewer lanes to keep, and a slow spell of
  the machine only ever adds time. Where the second pass measured more, it measured the machine: one bench run
  under a slow spell timed a size-1 step at 122.8 ms in the 8-node program and 68.7 ms in the 64-node one minutes
  before, and ProPD, its trees looking cheap against that size 1, took 8-node trees and ran 0.947x plain."""
  bound = dict(zip(first_pass["sizes"], first_pass["seconds"]))
  capped = [s for s, t in zip(sizes, seconds) if t > bound[s]]
  return [min(t, bound[s]) for s, t in zip(sizes, seconds)], capped


def _time_sizes(model, ids, drafter, tree_size, steps, repeats, pruning, prepare_kw) -> tuple[list[int], list[float]]:
  """(sizes, seconds per step at each) of the ProPD program compiled for a `tree_size`-node tree.

  The repeats run in rounds, each timing every size's short and long run once, and each run keeps its fastest
  round: a slow spell of a shared machine then costs every size one round, not all of one size's repeats (timed
  size by size, one bench run measured T(4) = 1.9 T(1) in one program and 1.1 T(1) in the other, minutes apart)."""
  rules, _ = rules_and_inputs(drafter, tree_size=tree_size, dynamic=True, latency=(1.0, 1.0))
  preps = {(size, tokens): _pinned(model, ids, drafter, tree_size, size, rules.sizes, tokens, pruning, prepare_kw)
           for size in rules.sizes for tokens in (steps, 2 * steps)}
  for tokens in (steps, 2 * steps):  # compile both programs (every pinned size runs the same two)
    api.run_prepared(preps[rules.sizes[0], tokens])
  best = dict.fromkeys(preps, (np.inf, 0))
  for _ in range(max(repeats, 1)):
    for key, prep in preps.items():
      runs, seconds = api.run_prepared(prep)
      best[key] = min(best[key], (seconds, max(r.steps for r in runs)))
  per_step = []
  for size in rules.sizes:
    short, long = best[size, steps], best[size, 2 * steps]
    differs = long[1] > short[1] and long[0] > short[0]  # (else: ended early, or noise: whole-run average)
    per_step.append((long[0] - short[0]) / (long[1] - short[1]) if differs else long[0] / max(long[1], 1))
  return list(rules.sizes), per_step


def _pinned(model, ids, drafter, tree_size, size, sizes, tokens, pruning, prepare_kw):
  """The ProPD loop writing up to `tokens` tokens with its tree size pinned to `size` (latency 1 there, 1e9
  elsewhere: every size runs the same compiled program)."""
  pinned = {s: 1.0 if s == size else 1e9 for s in sizes}
  rules, inputs = rules_and_inputs(drafter, tree_size=tree_size, dynamic=True, latency=pinned, prune=pruning)
  rules = dataclasses.replace(rules, softcap=model.config.final_logit_softcap)
  return api.prepare(model, ids, rules=rules, lanes=rules.tree.size, max_threads=rules.tree.size,
                     rule_inputs=inputs, max_new_tokens=tokens, **prepare_kw)
