"""Medusa and ProPD (paper 004) on the real Gemma 3 270M against plain greedy decoding, side by side.

For each batch size: the same held-out prompts (alpaca_eval_805, chat turns, greedy, up to --new-tokens
answer tokens) decoded by
  - plain   one token per step (`Sequential()`);
  - medusa  Medusa's fixed tree of --tree nodes (64: the size of Medusa's default tree), built by Medusa's
            recipe from the heads' calibrated hit rates, and every smaller fixed tree in --small-trees;
  - propd   ProPD's dynamic tree size (prefixes of the --tree-node tree), its step times T(s) (each lane bucket's
            as measured, or with --latency-model line the paper's T(s) = alpha s + beta) calibrated first on this
            device and batch size (`speculation.calibrate_latency`), and its early
            pruning when the heads folder has a trained early head (`decode/rules/pruning.py`; without one, ProPD
            does not prune and this row equals the next);
  - propd-line  with --latency-model buckets,line: ProPD again, its table on the paper's line (its own calibration);
  - propd-unpruned  the same without early pruning (its own calibration), to show what pruning gives (only with
            an early head: without one, ProPD does not prune and this row would repeat the last);
  - propd-never-hit  with --never-hit: where no tree pays, ProPD's floor. Its heads rank only tokens the model never
            writes (`never_hit_drafter`), so no guess is ever right, while its prior is the shipped heads' (it has to
            find out by probing); ProPD's step-time table, and its tree compiled (the calibration's timed tree, even
            where ProPD itself would compile none), so that it runs its own program and should match plain decoding.
Every program is compiled and run once before timing; figures are medians of --runs rounds, each of which runs
every method once in turn on each prompt group (a slow spell of the machine then lands on every method alike).
Each ProPD row's calibration ends with a break-even line: the tokens a step of each timed size must write on average
to match plain decoding and to run --target times as fast (`speculation.accepted_needed`), against the most it can
write; at size 2, the share of steps on which head 0 must be right.
Tree decoding is lossless, so every method writes the same tokens (checked: mismatches are printed and counted) and the
tokens/s ratios are time ratios. Accepted length = tokens per step; per-head acceptance = how often head h's
top-1 (and its top-k list) held the right token when its depth was reached.

  python -m bench.medusa [--batches 1,8] [--limit 8] [--limit-b1 4] [--runs 3] [--heads DIR] [--certify-head]
                         [--never-hit] [--target 1.3]
Last line: RESULT propd_b1=... propd_b8=... medusa_b1=... accept_len_b1=... unpruned_b1=... unpruned_b8=...
propd_never_hit_b1=... propd_never_hit_b8=... (tokens/s over plain's; nan: not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bench.common import held_out_prompt_ids
from pasta_jax.decode import api, loop
from pasta_jax.decode.latency import calibrate_latency
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.speculation import LATENCY_MODELS, Drafter, accepted_needed, load_drafter
from pasta_jax.methods import Medusa, Method, Propd, Sequential, prepare_run
from pasta_jax.model.load import load_model


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.medusa", description=__doc__.split("\n\n")[0])
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--limit", type=int, default=8, help="held-out prompts (batch 1 decodes each alone)")
  parser.add_argument("--limit-b1", type=int, default=4, help="of those, how many batch 1 decodes")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--tree", type=int, default=64, help="Medusa's fixed tree and ProPD's largest")
  parser.add_argument("--small-trees", default="2,4,8,16")
  parser.add_argument("--big-tree-batches", default="1",
                      help="batch sizes that also time the fixed --tree-node tree (64 nodes x batch 8 is ~6 s a "
                           "step on a 2-core CPU)")
  parser.add_argument("--model", default=None, help="default: the tuned default model")
  parser.add_argument("--heads", default=None, help="Medusa heads folder (default: the model's shipped heads)")
  parser.add_argument("--latency-model", default="buckets",
                      help="ProPD's step-time table: buckets (each size as measured) or line (the tree sizes on the "
                           "fitted line; speculation.step_times); a comma list times ProPD with each, side by side "
                           "(rows propd, propd-line)")
  parser.add_argument("--certify-head", action="store_true",
                      help="every method's greedy choices certified against the float32 head at a narrow head's "
                           "cost (int8 on a CPU; decode/certified_head.py): the same tokens, cheaper tree steps")
  parser.add_argument("--target", type=float, default=1.3,
                      help="the speed-up over plain decoding whose price the break-even lines state: the tokens a "
                           "step of each tree size must write on average to reach it (speculation.accepted_needed)")
  parser.add_argument("--never-hit", action="store_true",
                      help="also time ProPD whose heads never guess right (row propd-never-hit): no tree pays, and "
                           "ProPD should decode as fast as plain decoding")
  args = parser.parse_args(argv)
  unknown = set(args.latency_model.split(",")) - set(LATENCY_MODELS)
  if unknown:  # before the model loads
    parser.error(f"--latency-model: unknown {sorted(unknown)}; choose from {', '.join(LATENCY_MODELS)}")
  return args


NEVER_WRITTEN = 6000  # <unused6000>, ...: reserved tokens past every tag (Pred-1x's run to <unused570>), never written


def never_hit_drafter(model, drafter: Drafter) -> Drafter:
  """`drafter` with a draft vocabulary of top-k reserved tokens the model never writes (<unused6000>, ...): its heads
  run as they do (the same weights and shapes), and their every guess is wrong. The prior hit rates stay the shipped
  heads', so ProPD believes trees may pay until its probes show otherwise."""
  ids = [model.tokenizer.token_to_id(f"<unused{NEVER_WRITTEN + i}>") for i in range(drafter.top_k)]
  if None in ids:
    raise SystemExit(f"--never-hit: the tokenizer of {model.source} lacks <unused{NEVER_WRITTEN}> ... "
                     f"<unused{NEVER_WRITTEN + drafter.top_k - 1}>")
  heads = {**drafter.heads, "vocab": jnp.asarray(ids, jnp.int32)}
  if "out" in heads:  # own head rows per Medusa head: as many as the draft vocabulary
    heads["out"] = heads["out"][:, :len(ids)]
  return dataclasses.replace(drafter, heads=heads, source=f"{drafter.source} (never-hit)")


def timed(model, groups, runs: int, methods: dict[str, Method], **kw) -> dict[str, dict]:
  """Every method ({name: method value}, `prepare_run`'s options `kw`; the first is the baseline) on every group (a
  batch of prompt ids), side by side: per group, each method's program is compiled and run once, then `runs` rounds
  run every method once in turn, and each method keeps its median. In rounds, a slow spell of a shared machine lands
  on every method alike instead of on whichever was being timed (a method-major order once put medusa-4 at 1.05x
  plain and, on another run, 1.24x). The group's programs are dropped after it (kept, every group's exhaust the
  process's memory maps). Each row also says whether the method ran the baseline's own executable in every group,
  and by how much (max / min - 1) its runs of one group differed at most: the machine's noise."""
  outs, seconds = {name: [] for name in methods}, {name: [] for name in methods}
  shared, spread = dict.fromkeys(methods, True), dict.fromkeys(methods, 0.0)
  baseline = next(iter(methods))
  for ids in groups:
    preps = {name: prepare_run(model, ids, method, **kw) for name, method in methods.items()}
    for name, prep in preps.items():
      outs[name].extend(api.run_prepared(prep)[0])
    executable = {name: api.COMPILED.get(prep, loop.prefill_and_run) for name, prep in preps.items()}
    for name in methods:
      shared[name] &= executable[name] is executable[baseline]
    times = {name: [] for name in methods}
    for _ in range(runs):
      for name, prep in preps.items():
        times[name].append(api.run_prepared(prep)[1])
    for name in methods:
      seconds[name].append(statistics.median(times[name]))
      spread[name] = max(spread[name], max(times[name]) / min(times[name]) - 1)
    drop_programs()
  return {name: {**summary(outs[name], sum(seconds[name])), "method": method, "baseline_program": shared[name],
                 "spread": spread[name]} for name, method in methods.items()}


def drop_programs() -> None:
  api.COMPILED.clear()
  jax.clear_caches()


def summary(results: list, seconds: float) -> dict:
  tokens = sum(len(r.records) for r in results)
  stats = [r.rule_outputs for r in results if r.rule_outputs]
  return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "outs": results,
          "accept": float(np.mean([s["accept_length"] for s in stats])) if stats else 1.0, "stats": stats}


def head_rates(stats: list[dict]) -> tuple[list[float], list[float]]:
  trials = np.sum([s["head_trials"] for s in stats], axis=0)
  top1 = np.sum([np.asarray(s["head_top1"]) * s["head_trials"] for s in stats], axis=0) / np.maximum(trials, 1)
  topk = np.sum([np.asarray(s["head_topk"]) * s["head_trials"] for s in stats], axis=0) / np.maximum(trials, 1)
  return top1.tolist(), topk.tolist()


def mismatches(plain, other) -> int:
  return sum(1 for a, b in zip(plain["outs"], other["outs"])
             if a.records[:, 3].tolist() != b.records[:, 3].tolist())


def bench_batch(model, drafter, ids, batch: int, args) -> dict:
  ids = ids[: args.limit_b1] if batch == 1 else ids
  groups = [ids[i:i + batch] for i in range(0, len(ids), batch)]
  runtime = Runtime(certify_head=args.certify_head)
  methods: dict[str, Method] = {"plain": Sequential()}
  big = [args.tree] if str(batch) in args.big_tree_batches.split(",") else []
  for size in big + [int(s) for s in args.small_trees.split(",") if s]:
    methods[f"medusa-{size}"] = Medusa(tree_size=size, heads=drafter)
  calibrations = {}
  # Without a trained early head ProPD does not prune (speculation.early_prune): "propd-unpruned" would be the
  # same configuration, timed twice.
  prunings = (("propd", None), ("propd-unpruned", False)) if drafter.early_head is not None else (("propd", None),)
  models = args.latency_model.split(",")  # the first is ProPD's own row, the others "propd-<model>"
  variants = [(f"{name}-{m}" if i else name, prune, m) for name, prune in prunings for i, m in enumerate(models)]
  for name, prune, latency_model in variants:
    calibrations[name] = calibrate_latency(model, groups[0], drafter, tree_size=args.tree, steps=16,
                                           run_tokens=args.new_tokens, latency_model=latency_model, runtime=runtime,
                                           prune=prune)
    methods[name] = Propd(tree_size=calibrations[name]["tree_size"], heads=drafter,
                          latency=calibrations[name]["table"], prune=prune)
  if args.never_hit:  # the step times do not depend on what the heads guess: ProPD's own table
    cal = calibrations["propd"]
    methods["propd-never-hit"] = Propd(tree_size=cal["timed_tree"], heads=never_hit_drafter(model, drafter),
                                       latency=cal["table"], prune=False)
  drop_programs()  # the calibrations'
  rows = timed(model, groups, args.runs, methods, max_new_tokens=args.new_tokens, runtime=runtime)
  for name, calibration in calibrations.items():
    rows[name]["calibration"] = calibration
  return rows


def break_even_line(name: str, drafter: Drafter, sizes, seconds, target: float) -> str:
  """What a tree of each timed size must write a step to match plain decoding and to reach `target` times it,
  against the most it can write (its prefix's depth + 1)."""
  table = dict(zip(sizes, seconds))
  tree = drafter.tree(max(sizes))
  even, goal = accepted_needed(tree, table), accepted_needed(tree, table, target)
  most = {s: int(tree.depth[:s].max()) + 1 for s in even}
  return (f"{name} break-even (tokens a step must write: to match plain / for {target:g}x / at most): "
          + ", ".join(f"size {s} {even[s]:.2f} / {goal[s]:.2f} / {most[s]}" for s in even)
          + (f"; size 2 for {target:g}x needs head 0 right on {goal[2] - 1:.0%} of steps" if goal.get(2, 3) <= 2
             else ""))


def report(batch: int, rows: dict, target: float = 1.3) -> None:
  plain = rows["plain"]["tok_s"]
  print(f"\nbatch {batch}: {rows['plain']['tokens']} tokens per method")
  print(f"{'method':>14} {'tokens/s':>9} {'x plain':>8} {'accept':>7} {'mismatch':>8} {'pruned':>7}  "
        "tree sizes chosen")
  for name, r in rows.items():
    pruned = np.mean([s["prune_rate"] for s in r["stats"]]) if r["stats"] else 0.0
    sizes = {}
    for s in r["stats"]:
      for k, v in s["tree_sizes"].items():
        sizes[k] = sizes.get(k, 0) + v
    chosen = ""
    if isinstance(r["method"], Propd):
      plain_steps, probes = (sum(s.get(key, 0) for s in r["stats"]) for key in ("plain_steps", "probes"))
      chosen = (" ".join(f"{k}:{v}" for k, v in sorted(sizes.items()) if v)
                + f" (plain decoding's step: {plain_steps}; probes: {probes})")
    if name != "plain" and r["baseline_program"]:
      chosen += " plain's own executable: its ratio is the machine's noise"
    print(f"{name:>14} {r['tok_s']:9.2f} {r['tok_s'] / plain:8.3f} {r['accept']:7.2f} "
          f"{mismatches(rows['plain'], r):8d} {pruned:7.1%}  {chosen}")
  print(f"runs of one program differed by up to {max(r['spread'] for r in rows.values()):.1%} "
        f"(plain's: {rows['plain']['spread']:.1%}); a ratio closer to 1 than that is within the machine's noise")
  for name in (n for n, r in rows.items() if isinstance(r["method"], Propd) and "calibration" in r):
    cal = rows[name]["calibration"]
    times = lambda c: " ".join(f"T({s})={t * 1e3:.1f}ms" for s, t in zip(c["sizes"], c["seconds"]))
    if cal.get("first_pass"):
      print(f"{name} latency calibration, {cal['first_pass']['tree_size']}-node program: {times(cal['first_pass'])}")
    compiled = (f"compiled tree {cal['tree_size']} nodes (speculation.compiled_size)" if cal["tree_pays"] else
                "no tree pays: plain decoding's program (speculation.tree_pays)")
    if cal.get("capped"):
      compiled += f"; sizes {cal['capped']} timed slower than in the bigger program, capped at its times"
    print(f"{name} latency calibration, {cal['timed_tree']}-node program: {times(cal)} (table: "
          f"{cal['latency_model']}); fit "
          f"alpha={cal['alpha'] * 1e3:.2f} ms/node beta={cal['beta'] * 1e3:.1f} ms; {compiled}")
    print(break_even_line(name, rows[name]["method"].heads, cal["sizes"], cal["seconds"], target))
  medusa_key = max((k for k, r in rows.items() if type(r["method"]) is Medusa), key=lambda k: rows[k]["accept"])
  top1, topk = head_rates(rows[medusa_key]["stats"])
  print(f"per-head acceptance ({medusa_key}): top-1 " + " ".join(f"{x:.3f}" for x in top1)
        + " | top-k " + " ".join(f"{x:.3f}" for x in topk))
  if "propd-never-hit" in rows:
    r = rows["propd-never-hit"]
    top1, topk = head_rates(r["stats"])
    print(f"propd-never-hit: {r['method'].tree_size}-node tree compiled; head 0 checked on "
          f"{sum(s['head_trials'][0] for s in r['stats'])} probes, top-k right {topk[0]:.3f}")


def main(argv=None) -> None:
  args = parse_args(argv)
  model = load_model(args.model)
  drafter = load_drafter(model, args.heads)
  ids = held_out_prompt_ids(model, args.limit)
  early = f"trained, layer {drafter.early_layer}" if drafter.early_head is not None else "none: ProPD does not prune"
  print(f"model {model.source}; heads {drafter.source} ({drafter.config.num_heads} heads, top-{drafter.top_k}, "
        f"early head: {early}); "
        f"{len(ids)} prompts, {args.new_tokens} new tokens, greedy"
        f"{f' (certified {api.narrow_head_dtype(None, True)} head)' if args.certify_head else ''}; "
        f"medians of {args.runs} runs")
  print(api.head_plan_line(model.config, jnp.float32, certify_head=args.certify_head))  # every method's program
  results = {}
  for batch in tqdm([int(b) for b in args.batches.split(",")], desc="batch sizes"):
    results[batch] = bench_batch(model, drafter, ids, batch, args)
    report(batch, results[batch], args.target)

  def ratio(batch, name):
    rows = results.get(batch) or {}
    return rows[name]["tok_s"] / rows["plain"]["tok_s"] if name in rows else float("nan")  # nan: not timed

  small = {b: max((k for k, r in rows.items() if type(r["method"]) is Medusa and r["method"].tree_size != args.tree),
                  key=lambda k: rows[k]["tok_s"], default=None) for b, rows in results.items()}
  for b, k in small.items():
    if k:
      print(f"best fixed small tree at batch {b}: {k} ({ratio(b, k):.3f}x plain)")
  accept = results[1]["propd"]["accept"] if 1 in results else float("nan")
  print(f"RESULT propd_b1={ratio(1, 'propd'):.3f} propd_b8={ratio(8, 'propd'):.3f} "
        f"medusa_b1={ratio(1, f'medusa-{args.tree}'):.3f} accept_len_b1={accept:.2f} "
        f"unpruned_b1={ratio(1, 'propd-unpruned'):.3f} unpruned_b8={ratio(8, 'propd-unpruned'):.3f} "
        f"propd_never_hit_b1={ratio(1, 'propd-never-hit'):.3f} propd_never_hit_b8={ratio(8, 'propd-never-hit'):.3f}")


if __name__ == "__main__":
  main()
