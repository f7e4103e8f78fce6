"""PASTA x token trees (method "pasta+medusa") on the real Gemma 3 270M, beside PASTA and Medusa alone.

The tuned default model writes its own tags (free decoding) on held-out alpaca_eval_805 prompts (chat turns,
greedy, batch 1 by default, up to --new-tokens answer tokens), decoded by
  - sequential     one token per step, no threads (the same model: its answer has no forks);
  - medusa-N       Medusa's fixed N-node tree on that one thread;
  - pasta          the interpreter: the model's forks run as parallel threads;
  - pasta+medusa-N the same, every live thread with its own N-node tree in the same step.
Greedy tree acceptance is lossless, so pasta+medusa writes pasta's answer token for token (checked: differing
answers are counted) and medusa writes sequential's; their time ratios are speedups on the same text.
Every program runs once before timing; times are medians of --runs runs.

  python -m bench.pasta_trees [--limit 8] [--runs 3] [--trees 2,4,8] [--batch 1]
Steps are reported too: on this CPU every extra row of a step costs a row of the 262k-word output head, but on a
launch-bound accelerator a step's time hardly depends on its rows, and then steps are what time follows.
Last line: RESULT trees_over_pasta=... (fastest tree) pasta_over_sequential=... trees_over_sequential=...
  accept_len=... steps_pasta_over_trees=... steps_sequential_over_trees=... (the tree with the fewest steps)
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
from tqdm import tqdm

from bench.common import held_out_prompt_ids
from pasta_jax.decode import api
from pasta_jax.decode.speculation import load_drafter
from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.methods import Medusa, Method, Pasta, PastaTrees, Sequential, prepare_run
from pasta_jax.model.load import load_model


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.pasta_trees", description=__doc__.split("\n\n")[0])
  parser.add_argument("--limit", type=int, default=8, help="held-out prompts")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--trees", default="2,4,8", help="tree sizes of pasta+medusa (and medusa)")
  parser.add_argument("--lanes", type=int, default=8, help="PASTA's thread lanes")
  parser.add_argument("--model", default=None, help="default: the tuned default model")
  parser.add_argument("--heads", default=None, help="Medusa heads folder (default: the model's shipped heads)")
  return parser.parse_args(argv)


def timed(model, groups, runs: int, method: Method, **kw) -> dict:
  """Decodes every group once to compile, then `runs` times: median seconds, the results, mean accepted length."""
  outs, seconds = [], 0.0
  lang = LangTokenizer(model.tokenizer)
  for ids in groups:
    prep = prepare_run(model, ids, method, **kw)
    runs_out, _ = api.run_prepared(prep)
    time = statistics.median(api.run_prepared(prep)[1] for _ in range(runs))
    seconds += time
    outs.extend(api.to_result(r, time, lang, prep) for r in runs_out)
  jax.clear_caches()  # every row compiles its own programs: kept, they exhaust the process's memory maps
  accept = [o.speculation["accept_length"] for o in outs if o.speculation and o.speculation["tree_steps"]]
  return {"seconds": seconds, "outs": outs, "accept": float(np.mean(accept)) if accept else 1.0, "method": method}


def steps(row: dict) -> int:
  """Decode steps of every answer: what a launch-bound accelerator's time follows."""
  return sum(o.steps for o in row["outs"])


def differing(reference: dict, other: dict) -> int:
  """Answers whose annotated text differs (tree decoding is lossless: expected 0)."""
  return sum(a.annotated != b.annotated for a, b in zip(reference["outs"], other["outs"], strict=True))


def main(argv=None) -> None:
  args = parse_args(argv)
  model = load_model(args.model)
  drafter = load_drafter(model, args.heads)
  ids = held_out_prompt_ids(model, args.limit)
  groups = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
  trees = [int(s) for s in args.trees.split(",") if s]
  print(f"model {model.source}; heads {drafter.source}; {len(ids)} prompts, batch {args.batch}, "
        f"{args.new_tokens} new tokens, greedy, {args.lanes} PASTA lanes; medians of {args.runs} runs")
  methods: dict[str, Method] = {"sequential": Sequential()}
  methods.update({f"medusa-{n}": Medusa(tree_size=n, heads=drafter) for n in trees})
  methods["pasta"] = Pasta(lanes=args.lanes)
  methods.update({f"pasta+medusa-{n}": PastaTrees(lanes=args.lanes, tree_size=n, heads=drafter) for n in trees})
  rows = {name: timed(model, groups, args.runs, method, max_new_tokens=args.new_tokens)
          for name, method in tqdm(methods.items(), desc="methods")}
  forks = sum(len(r.threads) > 1 for r in rows["pasta"]["outs"])
  print(f"answers that fork (pasta): {forks} of {len(ids)}")
  print(f"{'method':>16} {'seconds':>8} {'content tok':>11} {'steps':>6} {'x sequential':>12} {'x pasta':>8} "
        f"{'accept':>7} {'differ':>6}")
  for name, r in rows.items():
    reference = rows["pasta"] if isinstance(r["method"], (Pasta, PastaTrees)) else rows["sequential"]
    content = sum(o.content_tokens for o in r["outs"])
    print(f"{name:>16} {r['seconds']:8.2f} {content:11d} {steps(r):6d} "
          f"{rows['sequential']['seconds'] / r['seconds']:12.3f} {rows['pasta']['seconds'] / r['seconds']:8.3f} "
          f"{r['accept']:7.2f} {differing(reference, r):6d}")
  best = min((f"pasta+medusa-{s}" for s in trees), key=lambda k: rows[k]["seconds"])
  fewest = min((f"pasta+medusa-{s}" for s in trees), key=lambda k: steps(rows[k]))
  seq, pasta = rows["sequential"]["seconds"], rows["pasta"]["seconds"]
  print(f"fastest tree on every thread: {best}; fewest steps: {fewest}")
  print(f"RESULT trees_over_pasta={pasta / rows[best]['seconds']:.3f} pasta_over_sequential={seq / pasta:.3f} "
        f"trees_over_sequential={seq / rows[best]['seconds']:.3f} accept_len={rows[best]['accept']:.2f} "
        f"steps_pasta_over_trees={steps(rows['pasta']) / steps(rows[fewest]):.3f} "
        f"steps_sequential_over_trees={steps(rows['sequential']) / steps(rows[fewest]):.3f}")


if __name__ == "__main__":
  main()
