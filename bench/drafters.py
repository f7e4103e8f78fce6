"""How often Medusa heads guess right, several drafters side by side, on the answers plain greedy decoding writes.

A tree step pays only when its guesses are accepted: at batch 1 on a 2-core CPU a 2-node step costs about 1.1-1.2
plain ones, so ProPD's 1.3x needs head 0 right on about half the steps (`bench.medusa`'s break-even line). This
bench measures that share directly, without timing a decode: the default model answers --limit prompts greedily
(the certified head: plain greedy's tokens), the answers are teacher-forced once, and every drafter ranks each
answer position from the same hidden states (and, for heads that read it, the token just chosen). Two prompt sets:
  bench  the first --limit alpaca_eval_805 instructions, bench.medusa's prompts (held out of every training pool);
  pool   --limit training-pool instructions from --pool-start on, past the prompts `train.medusa` distils.
Per drafter and set: each head's top-1 and top-k hit rate, head 0's top-1 per prompt (its spread), and the heads'
pass on one row (ms, median of --runs: what a tree step adds for them).

  python -m bench.drafters [--heads DIR,DIR] [--limit 8] [--pool-start 4000] [--top-k 10]
Last line: RESULT <drafter>_head0_bench=... <drafter>_head0_pool=... per drafter (the shipped heads: `shipped`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import held_out_prompt_ids, median_time, table
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.speculation import MEDUSA_DIR
from pasta_jax.decode.tokenizing import prompt_ids
from pasta_jax.methods import Sequential, generate_ids
from pasta_jax.model import medusa
from pasta_jax.model.load import load_model
from pasta_jax.training.medusa import distill
from pasta_jax.training.medusa.heads import compute_hidden, head_ranks


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.drafters", description=__doc__.split("\n\n")[0])
  parser.add_argument("--heads", default="", help="comma list of heads folders (default: the model's shipped heads)")
  parser.add_argument("--model", default=None, help="default: the tuned default model")
  parser.add_argument("--limit", type=int, default=8, help="prompts per set")
  parser.add_argument("--pool-start", type=int, default=4000, help="first training-pool prompt of the pool set")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--top-k", type=int, default=10)
  parser.add_argument("--runs", type=int, default=20, help="timed runs of each drafter's pass on one row")
  return parser.parse_args(argv)


def answers(model, ids: list[list[int]], new_tokens: int) -> list[dict]:
  """Plain greedy answers (the certified head: float32 greedy's tokens) as distill rows."""
  results = generate_ids(model, ids, Sequential(), max_new_tokens=new_tokens, runtime=Runtime(certify_head=True))
  eos = set(model.tokenizer.eos_ids)
  return [{"prompt_ids": list(map(int, p)), "answer_ids": distill.answer_ids(r, eos)} for p, r in zip(ids, results)]


def pass_ms(model, heads: dict, config, runs: int) -> float:
  """ms of the heads' pass on one row, as a tree step runs it: bfloat16 draft rows, top-k over them, the weights
  arguments of the program (as rule inputs are), not constants folded into it (which XLA:CPU ran twice as slow)."""
  embedding = model.params["params"]["embedder"]
  drafted = medusa.draft_rows(heads, embedding)
  h = jnp.ones((1, embedding.shape[1]), jnp.float32)
  nxt = jnp.zeros((1,), jnp.int32)
  fn = jax.jit(lambda heads, drafted, embedding, h, nxt: medusa.head_top_tokens(
      heads, h, drafted, 10, None, medusa.next_features(embedding, nxt) if config.next_token else None))
  args = (heads, drafted, embedding, h, nxt)
  jax.block_until_ready(fn(*args))
  return 1e3 * median_time(lambda: jax.block_until_ready(fn(*args)), runs)[0]


def scores(ranks: np.ndarray, targets: np.ndarray, lengths: list[int]) -> dict:
  """Per-head top-1 and top-k hit rates over positions with a target, and head 0's top-1 per prompt."""
  valid = targets >= 0
  first = ranks[..., 0] == targets
  anywhere = np.any(ranks == targets[..., None], axis=-1)
  per_prompt = [float(np.mean(first[a:b, 0])) for a, b in zip(np.cumsum([0] + lengths[:-1]), np.cumsum(lengths))]
  return {"top1": (first & valid).sum(0) / np.maximum(valid.sum(0), 1),
          "topk": (anywhere & valid).sum(0) / np.maximum(valid.sum(0), 1), "per_prompt": per_prompt}


def positions_per_row(rows: list[dict], num_heads: int) -> list[int]:
  return [len(medusa.position_targets(np.asarray(r["prompt_ids"] + r["answer_ids"]), len(r["prompt_ids"]),
                                      num_heads)[0]) for r in rows]


def main(argv=None) -> int:
  args = parse_args(argv)
  model = load_model(args.model)
  folders = [Path(f) for f in args.heads.split(",") if f] or [Path(str(model.source)) / MEDUSA_DIR]
  drafters = {}
  for folder in folders:
    heads, config, _ = medusa.load_heads(folder)
    name = "shipped" if folder.name == MEDUSA_DIR else (folder.parent.name if folder.name == "heads" else folder.name)
    drafters[name] = (heads, config)
  num_heads = max(c.num_heads for _, c in drafters.values())
  pool_prompts = distill.prompts_from_pools(args.pool_start + args.limit)[args.pool_start:]
  sets = {"bench": held_out_prompt_ids(model, args.limit),
          "pool": prompt_ids(model.tokenizer, pool_prompts, chat=True)}
  rows_out, result = [], []
  for set_name, ids in sets.items():
    rows = answers(model, ids, args.new_tokens)
    states, targets, next_tokens = compute_hidden(model, rows, num_heads)
    lengths = positions_per_row(rows, num_heads)
    print(f"{set_name}: {len(rows)} prompts, {len(states)} answer positions")
    for name, (heads, config) in drafters.items():
      got = scores(head_ranks(model, heads, config, states, next_tokens, args.top_k),
                   targets[:, :config.num_heads], lengths)
      rows_out.append({"set": set_name, "drafter": name, "top1": " ".join(f"{x:.3f}" for x in got["top1"]),
                       f"top{args.top_k}": " ".join(f"{x:.3f}" for x in got["topk"]),
                       "head0 per prompt": f"{min(got['per_prompt']):.2f}..{max(got['per_prompt']):.2f}"})
      result.append(f"{name}_head0_{set_name}={got['top1'][0]:.3f}")
  for name, (heads, config) in drafters.items():
    print(f"{name}: {config}; pass on one row {pass_ms(model, heads, config, args.runs):.2f} ms")
  print(table(rows_out, ("set", "drafter", "top1", f"top{args.top_k}", "head0 per prompt"), width=24))
  print("RESULT " + " ".join(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
