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
from pasta_jax.data.encode import EncodeConfig, encode_example
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import load_model


def head_timings(unembed, rows: int, runs: int) -> dict:
  """ms of the head on `rows` rows: float32 as `output_head` multiplies it, and bfloat16 padded to >= 2 rows."""
  x = jnp.ones((1, rows, unembed.shape[1]), jnp.float32)
  f32_form = "bqd,vd->bqv" if rows in (2, 3) else "bqd,vd->vbq"
  f32 = jax.jit(lambda x, e: jnp.einsum(f32_form, x, e, preferred_element_type=jnp.float32))
  bf16_unembed = unembed.astype(jnp.bfloat16)

  @jax.jit
  def bf16(x, e):
    padded = jnp.concatenate([x, x], axis=1) if x.shape[1] == 1 else x
    logits = jnp.einsum("bqd,vd->bqv", padded.astype(jnp.bfloat16), e, preferred_element_type=jnp.float32)
    return logits[:, :x.shape[1]]

  out = {}
  for name, fn, e in (("f32_ms", f32, unembed), ("bf16_ms", bf16, bf16_unembed)):
    jax.block_until_ready(fn(x, e))
    out[name] = 1e3 * median_time(lambda fn=fn, e=e: jax.block_until_ready(fn(x, e)), runs)[0]
  return out


def greedy_agreement(model, records, bucket: int = 128) -> tuple[list[float], list[int], list[float]]:
  """Per answer: (share of answer positions whose greedy token is the same under both heads, the first
  position where it is not (the answer length if none), the largest logit difference)."""
  tokenizer, vocab = model.tokenizer, model.tokenizer.tag_vocab()
  hidden_fn = jax.jit(lambda p, t, pos, m: Gemma(model.config).apply(p, t, pos, m, hidden_only=True))
  unembed = model.params["params"]["embedder"]
  unembed_bf16 = unembed.astype(jnp.bfloat16)
  agree, first, worst = [], [], []
  for record in tqdm(records, desc="teacher-forced answers"):
    example = {"instruction": record["instruction"], "output": record.get("reference") or record["output"]}
    probe = encode_example(example, tokenizer, vocab, EncodeConfig(seq_len=None, chat=True, objective="baseline_sft"))
    seq_len = -(-int(probe.length) // bucket) * bucket
    layout = encode_example(example, tokenizer, vocab,
                            EncodeConfig(seq_len=seq_len, chat=True, objective="baseline_sft"))
    batch = jax.tree.map(lambda x: jnp.asarray(x)[None], layout)
    hidden = hidden_fn(model.params, batch.tokens, batch.positions, batch.thread_mask())[0]  # [L, D]
    rows = np.flatnonzero(np.asarray(layout.loss_mask))
    h = hidden[rows]
    f32 = jnp.einsum("ld,vd->lv", h, unembed, preferred_element_type=jnp.float32)
    bf16 = jnp.einsum("ld,vd->lv", h.astype(jnp.bfloat16), unembed_bf16, preferred_element_type=jnp.float32)
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
