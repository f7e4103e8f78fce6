"""What a bfloat16 output head would buy on this device, and what it would change: a measurement, not a mode;
and how often the certified head (bfloat16 or int8) could certify a greedy choice without the float32 head.

On XLA:CPU one row of the float32 262k x 640 head goes through the gemv emitter (~23 ms on 2 cores) and 2-4 rows
through YNNPACK (31-38 ms), which is most of why a step of several lanes costs more than a step of one
(docs/interpreter.md, "Weight layout of the step"). With bfloat16 inputs and float32 accumulation YNNPACK's
matmul (AMX where the CPU has it) reads half the bytes. One bfloat16 row is slow (no fast gemv), so a 1-row head
would be padded to 2.

Speed: the head alone, float32 in its decode-layout forms against bfloat16 (padded to 2 rows) and the certified
head's int8 product (model/int8_head.py), for each Q.
Precision: the model (default: the shipped Baseline-SFT) is teacher-forced on the reference answers of
`--prompts` (chat turns, as `pasta eval` decodes them), and at every answer position the greedy token of the
float32 head is compared with that of the bfloat16 head (hidden state rounded to bfloat16 too). A greedy decoder
with the bfloat16 head would first part from the float32 one at the first position where they disagree.
Certificate: at every such position, the tokens whose upper bound (decode/certified_head.py) reaches the top
float32 logit; a row is certified when they fit the certified head's K exact tokens (`certified_head.CANDIDATES`).

  python -m bench.head_precision [--limit 40] [--model baseline-sft] [--rows 1 2 4 8] [--runs 7]
Last line: RESULT argmax_agree=... first_disagreement_median=... head_f32_q1_ms=... head_bf16_q2_ms=...
                  head_int8_q2_ms=... certified_bf16=... certified_int8=... (shares of positions)
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
from pasta_jax.decode import certified_head
from pasta_jax.eval.quality import answer_layout
from pasta_jax.model.gemma import Gemma, narrow_head, output_head
from pasta_jax.model.int8_head import int8_logits, quantize_head
from pasta_jax.model.load import load_model


def head_timings(unembed, rows: int, runs: int) -> dict:
  """ms of `gemma.output_head` on `rows` rows in the decode layout: the float32 head, and its bfloat16 copy; and of
  the certified head's int8 product."""
  x = jnp.ones((1, rows, unembed.shape[1]), jnp.float32)
  head = jax.jit(lambda x, e: output_head(x, e, True))
  int8 = jax.jit(lambda x, q, s: int8_logits(x, q, s)[0])
  forms = {"f32_ms": (head, (unembed,)), "bf16_ms": (head, (narrow_head(unembed, jnp.bfloat16),)),
           "int8_ms": (int8, quantize_head(unembed))}
  out = {}
  for name, (fn, w) in forms.items():
    jax.block_until_ready(fn(x, *w))
    out[name] = 1e3 * median_time(lambda fn=fn, w=w: jax.block_until_ready(fn(x, *w)), runs)[0]
  return out


def answer_rows(model, records) -> list[jax.Array]:
  """Per answer teacher-forced through `model`: the final-normed hidden rows [1, N, D] that predict its tokens."""
  hidden_fn = jax.jit(lambda p, t, pos, m: Gemma(model.config).apply(p, t, pos, m, skip_head=True).head_input)
  rows = []
  for record in tqdm(records, desc="teacher-forced answers"):
    batch = answer_layout(model, record["instruction"], record.get("reference") or record["output"])
    hidden = hidden_fn(model.params, batch.tokens, batch.positions, batch.thread_mask())  # [1, L, D]
    rows.append(hidden[:, np.flatnonzero(np.asarray(batch.loss_mask[0]))])
  return rows


def certificate_candidates(unembed, answers: list[jax.Array], head_dtype: str) -> np.ndarray:
  """Per answer position: how many tokens' upper bounds under the `head_dtype` certified head reach the position's
  top float32 logit (the top token's own included); the certificate holds when they fit its K exact tokens."""
  tree = {"embedder": unembed, **certified_head.narrow_params(unembed, head_dtype)}

  @jax.jit
  def count(h):  # [1, N, D] -> [N]
    top = output_head(h, unembed, True).max(-1, keepdims=True)
    return jnp.sum(certified_head.upper_bounds(tree, h) >= top, axis=-1)[0]

  return np.concatenate([np.asarray(count(h)) for h in answers])


def greedy_agreement(model, answers: list[jax.Array]) -> tuple[list[float], list[int], list[float]]:
  """Per answer: (share of answer positions whose greedy token is the same under both heads, the first
  position where it is not (the answer length if none), the largest logit difference)."""
  unembed = model.params["params"]["embedder"]
  unembed_bf16 = narrow_head(unembed, jnp.bfloat16)
  agree, first, worst = [], [], []
  for h in answers:
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
  answers = answer_rows(model, sources.read_records(args.prompts, args.limit))
  agree, first, worst = greedy_agreement(model, answers)
  positions = statistics.mean(agree)
  print(f"{len(agree)} reference answers teacher-forced: the greedy token agrees at {positions:.4f} of positions "
        f"(mean over answers); answers with no disagreement {sum(a == 1.0 for a in agree)}; first disagreement at "
        f"position {statistics.median(first):.0f} (median); largest logit difference {max(worst):.3f}")
  certified = {}
  for head_dtype in ("bfloat16", "int8"):
    counts = certificate_candidates(unembed, answers, head_dtype)
    certified[head_dtype] = float(np.mean(counts <= certified_head.CANDIDATES))
    print(f"certified {head_dtype} head: tokens at the bound per position median {np.median(counts):.0f}, p99 "
          f"{np.percentile(counts, 99):.0f}, max {counts.max()}; within K={certified_head.CANDIDATES}: "
          f"{certified[head_dtype]:.4f} of {len(counts)} positions (a row of several is certified when all are)")
  by_q = {r["Q"]: r for r in rows}
  print(f"RESULT argmax_agree={positions:.4f} first_disagreement_median={statistics.median(first):.0f} "
        f"head_f32_q1_ms={by_q.get(1, rows[0])['f32_ms']:.1f} head_bf16_q2_ms={by_q.get(2, rows[-1])['bf16_ms']:.1f} "
        f"head_int8_q2_ms={by_q.get(2, rows[-1])['int8_ms']:.1f} certified_bf16={certified['bfloat16']:.4f} "
        f"certified_int8={certified['int8']:.4f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
