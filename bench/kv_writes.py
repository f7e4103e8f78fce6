"""Deferred K/V writes against writes inside the lane-count switch, on the shipped model, side by side.

Multi-lane methods run the model inside a `lax.switch` over lane-count buckets. Written there, the KV pool is
copied by XLA:CPU into and out of the branch every step; deferred (`InterpreterConfig.defer_kv_writes`, the default
on a CPU, model/kv_rows.py) the branches only read it and the step writes the new rows after the switch. Both are
set explicitly here, on any backend. Workloads:
  - pasta:  the shipped default in free PASTA decoding, batch 1 (greedy, repetition penalty 1.1, distinct topics,
            certified head: `bench.learned`'s settings), one held-out prompt at a time;
  - propd:  ProPD at batch 8 on its 4-node tree with a step-time table that picks size 1 (the size it chose on 666
            of 677 steps in a batch-8 `bench.medusa` run on a 2-core CPU), so its steps are plain steps inside the tree
            program, and plain greedy decoding of the same prompts beside it.
Every program is compiled and run once first; then each of --rounds rounds runs every configuration once (a slow
spell of a shared machine lands on all alike) and each keeps its median. Both ways write the same tokens (counted).

  python -m bench.kv_writes [--limit 4] [--rounds 3] [--max-new-tokens 128] [--pasta-batch 16]
Last line: RESULT pasta_deferred_over_in_branch=... propd_b8_deferred_over_in_branch=... propd_size1_over_plain=...
[pasta_bN_deferred_over_in_branch=...]
(time ratios: in-branch seconds / deferred seconds, so above 1 is faster deferred; and ProPD's size-1 steps over
plain decoding, deferred, in tokens/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from tqdm import tqdm

from bench.common import held_out_prompt_ids, table
from pasta_jax.decode import api
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.speculation import load_drafter
from pasta_jax.methods import Pasta, Propd, Sequential, prepare_run
from pasta_jax.model.load import load_model

SIZE_ONE = {1: 0.001, 2: 1.0, 4: 1.0}  # seconds per step: no tree ever pays


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.kv_writes", description=__doc__.split("\n\n")[0])
  parser.add_argument("--limit", type=int, default=4, help="prompts for PASTA at batch 1")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--propd-tokens", type=int, default=64, help="new tokens of the batch-8 runs")
  parser.add_argument("--pasta-batch", type=int, default=0, help="also PASTA with this many prompts in one batch")
  parser.add_argument("--model", default=None, help="model (default: the shipped tuned default)")
  return parser.parse_args(argv)


def writes(prep: api.Prepared, defer: bool) -> api.Prepared:  # explicit: the default defers on a CPU only
  return dataclasses.replace(prep, cfg=dataclasses.replace(prep.cfg, defer_kv_writes=defer))


def in_branch(prep: api.Prepared) -> api.Prepared:
  return writes(prep, False)


def deferred(prep: api.Prepared) -> api.Prepared:
  return writes(prep, True)


def configurations(model, args) -> dict[str, list[api.Prepared]]:
  """{name: the prepared runs it times}: each workload deferred and in-branch (and plain beside ProPD)."""
  ids = held_out_prompt_ids(model, max(args.limit, 8, args.pasta_batch))
  sampling = SamplingConfig(repetition_penalty=1.1, distinct_topics=True)
  certified = Runtime(certify_head=True)
  pasta = [prepare_run(model, [p], Pasta(lanes=8), max_new_tokens=args.max_new_tokens, sampling=sampling,
                       runtime=certified) for p in ids[:args.limit]]
  common = dict(max_new_tokens=args.propd_tokens, runtime=certified)
  propd = prepare_run(model, ids[:8], Propd(tree_size=4, heads=load_drafter(model, None), latency=SIZE_ONE,
                                            prune=False), **common)
  plain = prepare_run(model, ids[:8], Sequential(), **common)
  configs = {"pasta deferred": [deferred(p) for p in pasta], "pasta in-branch": [in_branch(p) for p in pasta],
             "propd b8 deferred": [deferred(propd)], "propd b8 in-branch": [in_branch(propd)], "plain b8": [plain]}
  if args.pasta_batch:
    wide = prepare_run(model, ids[:args.pasta_batch], Pasta(lanes=8), max_new_tokens=args.max_new_tokens,
                       sampling=sampling, runtime=certified)
    name = f"pasta b{args.pasta_batch}"
    configs.update({f"{name} deferred": [deferred(wide)], f"{name} in-branch": [in_branch(wide)]})
  return configs


def tokens_of(outs) -> list[tuple]:
  return [tuple(int(t) for t in o.records[:, 3]) for o in outs]


def main(argv=None) -> None:
  args = parse_args(argv)
  model = load_model(args.model)
  configs = configurations(model, args)
  answers = {name: [tokens_of(api.run_prepared(p)[0]) for p in preps]  # compiles each program once
             for name, preps in tqdm(configs.items(), desc="compile and warm up")}
  seconds = {name: [] for name in configs}
  for _ in tqdm(range(args.rounds), desc="rounds"):
    for name, preps in configs.items():
      seconds[name].append(sum(api.run_prepared(p)[1] for p in preps))
  median = {name: statistics.median(s) for name, s in seconds.items()}
  # Loop steps: a batch's requests step together, so a run takes as many steps as its longest request.
  steps = {name: sum(max(o.steps for o in api.run_prepared(p)[0]) for p in preps) for name, preps in configs.items()}
  print(f"model {model.source}; {args.limit} PASTA prompts at batch 1 ({args.max_new_tokens} tokens), 8 prompts at "
        f"batch 8 ({args.propd_tokens} tokens); medians of {args.rounds} rounds")
  rows = [{"configuration": name, "seconds": median[name], "steps": steps[name],
           "ms/step": 1e3 * median[name] / steps[name], "runs": " ".join(f"{x:.1f}" for x in seconds[name])}
          for name in configs]
  print(table(rows, ("configuration", "seconds", "steps", "ms/step", "runs"), width=20))
  workloads = [n.removesuffix(" deferred") for n in configs if n.endswith(" deferred")]
  same = {w: answers[f"{w} deferred"] == answers[f"{w} in-branch"] for w in workloads}
  print("same tokens deferred and in-branch: " + ", ".join(f"{w} {same[w]}" for w in workloads)
        + f"; propd = plain greedy: {answers['propd b8 deferred'] == answers['plain b8']}")
  ratio = lambda w: median[f"{w} in-branch"] / median[f"{w} deferred"]
  print(f"RESULT pasta_deferred_over_in_branch={ratio('pasta'):.3f} propd_b8_deferred_over_in_branch="
        f"{ratio('propd b8'):.3f} propd_size1_over_plain={median['plain b8'] / median['propd b8 deferred']:.3f}"
        + "".join(f" {w.replace(' ', '_')}_deferred_over_in_branch={ratio(w):.3f}" for w in workloads[2:]))


if __name__ == "__main__":
  main()
