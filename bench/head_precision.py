"""What a bfloat16 output head would buy on this device, and what it would change: a measurement, not a mode.

On XLA:CPU one row of the float32 262k x 640 head goes through the gemv emitter (~23 ms on 2 cores) and 2-4 rows
through YNNPACK (31-38 ms), which is most of why a step of several lanes costs more than a step of one
(docs/interpreter.md, "Weight layout of the step"). With bfloat16 inputs and float32 accumulation YNNPACK's
matmul (AMX where the CPU has it) reads half the bytes. One bfloat16 row is slow (no fast gemv), so a 1-row head
would be padded to 2.

Speed: the head alone, float32 in its decode-layout forms against bfloat16 (padded to 2 rows), for each Q.
Precision: the model (default: the shipped Baseline-SFT) is teacher-forced on the reference answers of
`--prompts` (chat turns, as `pasta eval` decodes them), and at every answer position the greedy token of the
float32 head is compared with that of the bfloat16 head (hidden state rounded to bfloat16 too). A greedy decoder
with the bfloat16 head would first part from the float32 one at the first position where they disagree.

  python -m bench.head_precision [--limit 40] [--model baseline-sft] [--rows 1 2 4 8] [--runs 7]
Last line: RESULT argmax_agree=... first_disagreement_median=... head_f32_q1_ms=... head_bf16_q2_ms=...
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bench.common import median_time, table
from pasta_jax.data import sources
from pasta_jax.eval.quality import answer_layout
from pasta_jax.model.gemma import Gemma, narrow_head, output_head
from pasta_jax.model.load import load_model


def head_timings(unembed, rows: int, runs: int) -> dict:
  """ms of `gemma.output_head` on `rows` rows in the decode layout: the float32 head, and its bfloat16 copy."""
  x = jnp.ones((1, rows, unembed.shape[1]), jnp.float32)
  head = jax.jit(lambda x, e: output_head(x, e, True))
  out = {}
  for name, e in (("f32_ms", unembed), ("bf16_ms", narrow_head(unembed, jnp.bfloat16))):
    jax.block_until_ready(head(x, e))
    out[name] = 1e3 * median_time(lambda e=e: jax.block_until_ready(head(x, e)), runs)[0]
  return out


def greedy_agreement(model, records) -> tuple[list[float], list[int], list[float]]:
  """Per answer: (share of answer positions whose greedy token is the same under both heads, the first
  position where it is not (the answer length if none), the largest logit difference)."""
  hidden_fn = jax.jit(lambda p, t, pos, m: Gemma(model.config).apply(p, t, pos, m, hidden_only=True))
  unembed = model.params["params"]["embedder"]
  unembed_bf16 = narrow_head(unembed, jnp.bfloat16)
  agree, first, worst = [], [], []
  for record in tqdm(records, desc="teacher-forced answers"):
    batch = answer_layout(model, record["instruction"], record.get("reference") or record["output"])
    hidden = hidden_fn(model.params, batch.tokens, batch.positions, batch.thread_mask())  # [1, L, D]
    h = hidden[:, np.flatnonzero(np.asarray(batch.loss_mask[0]))]  # the rows that predict answer tokens
    f32, bf16 = output_head(h, unembed, True)[0], output_head(h, unembed_bf16, True)[0]
    same = np.asarray(jnp.argmax(f32, -1) == jnp.argmax(bf16, -1))
    agree.append(float(same.mean()))
    first.append(int(np.argmin(same)) if not same.all() else len(same))
    worst.append(float(jnp.abs(f32 - bf16).max()))
  return agree, first, worst


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.head_precision", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", default="alpaca_eval_805", help="records with instruction + reference/output")
  parser.add_argument("--limit", type=int, default=40)
  parser.add_argument("--model", default="baseline-sft")
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--runs", type=int, default=7)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  model = load_model(args.model)
  print(f"model: {model.describe()}; device: {jax.default_backend()}")
  unembed = jnp.asarray(model.params["params"]["embedder"], jnp.float32)
  rows = [{"Q": q, **head_timings(unembed, q, args.runs)} for q in args.rows]
  print(table(rows, tuple(rows[0])))
  agree, first, worst = greedy_agreement(model, sources.read_records(args.prompts, args.limit))
  positions = statistics.mean(agree)
  print(f"{len(agree)} reference answers teacher-forced: the greedy token agrees at {positions:.4f} of positions "
        f"(mean over answers); answers with no disagreement {sum(a == 1.0 for a in agree)}; first disagreement at "
        f"position {statistics.median(first):.0f} (median); largest logit difference {max(worst):.3f}")
  by_q = {r["Q"]: r for r in rows}
  print(f"RESULT argmax_agree={positions:.4f} first_disagreement_median={statistics.median(first):.0f} "
        f"head_f32_q1_ms={by_q.get(1, rows[0])['f32_ms']:.1f} head_bf16_q2_ms={by_q.get(2, rows[-1])['bf16_ms']:.1f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
