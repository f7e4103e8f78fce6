"""The output head's measured plan against the fixed one, in free decoding of the shipped model on this machine.

`model/head_timing.py` times the head's matmul forms once per process and compiles the fastest per row count. This
decodes held-out prompts with the shipped default (PASTA, batch 1, greedy), under the fixed plan and under the
measured one, with and without the certified head, in rounds (every configuration once per round, so a slow
spell of a shared machine costs all alike), and prints each configuration's median seconds per prompt, its
steps, and the measured plan over the fixed one. The answers must be the same (counted: they may differ only where
two logits tie to float32 rounding).

  python -m bench.head_plan [--limit 4] [--rounds 3] [--max-new-tokens 128]
Last line: RESULT measured_over_fixed=... certified_measured_over_fixed=... same_answers=...
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm

from bench.common import held_out_prompt_ids, table
from pasta_jax.decode import api
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.methods import Pasta, generate_ids
from pasta_jax.model import head_plan, head_timing
from pasta_jax.model.load import load_model

CONFIGS = [("fixed", False), ("measured", False), ("fixed", True), ("measured", True)]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.head_plan", description=__doc__.split("\n\n")[0])
  parser.add_argument("--limit", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--model", default=None, help="model (default: the shipped tuned default)")
  return parser.parse_args(argv)


def plans_for(model) -> dict:
  """{(plan, certified): HeadPlan}: the fixed plan, and the one this process would measure for each head."""
  config = model.config
  return {(name, certified): head_plan.FIXED if name == "fixed" else
          head_timing.measured_plan(config.vocab_size, config.embed_dim, "float32", "bfloat16" if certified else None)
          for name, certified in CONFIGS}


def use_plan(plan: head_plan.HeadPlan) -> None:
  """Decode under `plan` from now on: `api.head_plan` reads it, and the decode model is kept per plan (so each
  configuration's programs compile once)."""
  api.measured_plan = lambda *args: plan


def decode(model, ids, certify: bool, max_new_tokens: int) -> tuple[float, int, tuple]:
  """Seconds, steps and tokens of one prompt (the compiled program is kept per plan, so only a configuration's
  first run, the warm-up, compiles)."""
  [r] = generate_ids(model, [ids], Pasta(lanes=8), max_new_tokens=max_new_tokens,
                     sampling=SamplingConfig(repetition_penalty=1.1, distinct_topics=True),
                     runtime=Runtime(certify_head=certify))
  return r.seconds, r.steps, tuple(int(t) for t in r.records[:, 3])


def main(argv=None) -> int:
  args = parse_args(argv)
  model = load_model(args.model)
  prompts = held_out_prompt_ids(model, args.limit)
  seconds = {c: [[] for _ in prompts] for c in CONFIGS}
  answers, steps, plans = {}, {}, plans_for(model)
  for config in CONFIGS:  # warm-up: compile each configuration's programs
    use_plan(plans[config])
    for i, ids in enumerate(prompts):
      _, steps[config, i], answers[config, i] = decode(model, ids, config[1], args.max_new_tokens)
  bar = tqdm(total=args.rounds * len(CONFIGS) * len(prompts), desc="rounds")
  for _ in range(args.rounds):
    for config in CONFIGS:
      use_plan(plans[config])
      for i, ids in enumerate(prompts):
        seconds[config][i].append(decode(model, ids, config[1], args.max_new_tokens)[0])
        bar.update(1)
  bar.close()
  for config, plan in plans.items():
    print(f"{config[0]:>8} {'certified' if config[1] else 'float32':>9}: token-major rows {plan.token_major}, "
          f"exact rows {plan.exact}; timed ms {dict(plan.measured) or '(fixed: not timed)'}")
  for config, per in seconds.items():
    print(f"{config[0]:>8} {'certified' if config[1] else 'float32':>9}: seconds per prompt (each round) "
          + " | ".join(" ".join(f"{t:.2f}" for t in s) for s in per))
  total = {c: sum(statistics.median(s) for s in per) for c, per in seconds.items()}
  rows = [{"plan": c[0], "head": "certified" if c[1] else "float32", "seconds": total[c],
           "steps": sum(steps[c, i] for i in range(len(prompts))),
           "vs_fixed": total["fixed", c[1]] / total[c]} for c in CONFIGS]
  print(table(rows, ("plan", "head", "seconds", "steps", "vs_fixed")))
  same = sum(answers[("fixed", h), i] == answers[("measured", h), i]
             for h in (False, True) for i in range(len(prompts)))
  print(f"RESULT measured_over_fixed={total['fixed', False] / total['measured', False]:.3f} "
        f"certified_measured_over_fixed={total['fixed', True] / total['measured', True]:.3f} "
        f"same_answers={same}/{2 * len(prompts)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
