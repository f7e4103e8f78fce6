"""Superposed Decoding (paper 002) on the real Gemma 3 270M: k drafts from one decode against greedy
decoding and nucleus sampling, side by side in one run (any device; CPU here).

Prefixes: the first `--prefix` tokens (15, the paper's) of alpaca_eval_805's reference answers, which the
n-gram index never saw; plain continuation, no chat turns. For each generation length (10, the paper's,
and 64) and k in 2, 3, 5, every prefix is decoded
  - by Superposed Decoding with k drafts (n-gram smoothing from the default index);
  - greedily (one request), and by k nucleus samples (p = 0.9, T = 1) run one after the other and as one
    batch of k requests;
every program compiled and run once before timing (one timed run each: the prefixes are the repeats).
Nucleus sampling sorts the whole 262k vocabulary every step (exact top-p), which costs more than the
model's step on CPU: the "/ (k x greedy)" column is the floor of any k one-by-one decodes instead.
Quality as the paper measures it: perplexity under the model itself (the 270M at T = 1; no bigger model
can be loaded here) of the best of the k drafts against the mean over nucleus samples. Then the n-gram
index: build size and time, and one step's look-ups on device (jitted) against the same on the host.

  python -m bench.superposed [--prefixes 10] [--lengths 10,64] [--drafts 2,3,5]
Last line: RESULT time_k3_over_greedy=... time_k3_over_nucleus3=... ppl_best3_over_nucleus=... (length 10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bench.common import median_time
from pasta_jax.data import sources
from pasta_jax.data.ngram_corpus import ensure_default_index
from pasta_jax.decode import ngram
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.eval.quality import continuation_perplexity
from pasta_jax.methods import Sequential, Superposed, generate_ids
from pasta_jax.methods.superposed import load_index
from pasta_jax.model.load import load_model

NUCLEUS = [SamplingConfig(temperature=1.0, top_p=0.9, seed=s) for s in range(8)]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.superposed", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prefixes", type=int, default=10)
  parser.add_argument("--prefix", type=int, default=15, help="prefix tokens (BOS excluded)")
  parser.add_argument("--lengths", default="10,64")
  parser.add_argument("--drafts", default="2,3,5")
  parser.add_argument("--model", default="base")
  return parser.parse_args(argv)


def prefixes(model, count: int, length: int) -> list[list[int]]:
  out = []
  for record in sources.read_records("alpaca_eval_805"):
    ids = model.tokenizer.encode(record["reference"], add_bos=True)
    if len(ids) > length + 1:
      out.append(ids[: length + 1])
    if len(out) == count:
      return out
  return out


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def run_length(model, index_dir: str, ids, gen: int, ks: list[int]) -> dict:
  """Per-prefix wall times and perplexities for one generation length (`index_dir`: the n-gram index's folder)."""
  kmax = max(ks)
  seq = dict(max_new_tokens=gen)
  plain = Sequential(ignore_eos=True)
  spd_of = {k: Superposed(drafts=k, ngram=index_dir) for k in ks}
  warm = [ids[0]]
  generate_ids(model, warm, plain, **seq)
  generate_ids(model, warm, plain, sampling=NUCLEUS[0], **seq)
  for k in ks:
    generate_ids(model, warm, spd_of[k], max_new_tokens=gen)
    generate_ids(model, warm * k, plain, sampling=NUCLEUS[0], **seq)
  rows = {"greedy": [], **{f"spd{k}": [] for k in ks}, **{f"nucleus_seq{k}": [] for k in ks},
          **{f"nucleus_batch{k}": [] for k in ks}, **{f"ppl_best{k}": [] for k in ks},
          **{f"ppl_draft{k}_1": [] for k in ks}, "ppl_nucleus": [], "ppl_greedy": []}
  for prefix in tqdm(ids, desc=f"length {gen}", unit="prefix"):
    greedy, t = timed(lambda prefix=prefix: generate_ids(model, [prefix], plain, **seq)[0])
    rows["greedy"].append(t)
    rows["ppl_greedy"].append(continuation_perplexity(model, prefix, greedy.records[:, 3].tolist()))
    samples = []
    for s in range(kmax):
      out, t = timed(lambda s=s, prefix=prefix: generate_ids(model, [prefix], plain, sampling=NUCLEUS[s], **seq)[0])
      samples.append((out.records[:, 3].tolist(), t))
    rows["ppl_nucleus"].append(statistics.mean(continuation_perplexity(model, prefix, toks) for toks, _ in samples))
    for k in ks:
      rows[f"nucleus_seq{k}"].append(sum(t for _, t in samples[:k]))
      _, t = timed(lambda k=k, prefix=prefix: generate_ids(model, [prefix] * k, plain, sampling=NUCLEUS[0], **seq))
      rows[f"nucleus_batch{k}"].append(t)
      spd, t = timed(lambda k=k, prefix=prefix: generate_ids(model, [prefix], spd_of[k], max_new_tokens=gen)[0])
      rows[f"spd{k}"].append(t)
      ppls = [continuation_perplexity(model, prefix, d) for d in spd_drafts(model, spd)]
      rows[f"ppl_best{k}"].append(min(ppls))
      rows[f"ppl_draft{k}_1"].append(ppls[0])
  return rows


def spd_drafts(model, result) -> list[list[int]]:
  return [model.tokenizer.encode(d, add_bos=False) for d in result.drafts]


def lookup_cost(index: ngram.NgramIndex, k: int = 3) -> tuple[float, float]:
  """Seconds for one step's n-gram look-ups (k drafts x 3k candidates, orders 2..6): device, host."""
  rng = np.random.default_rng(0)
  starts = rng.integers(0, index.num_tokens - 6, size=k)
  context = np.stack([index.arrays.tokens[s: s + 5] for s in starts]).astype(np.int32)  # contexts that occur
  cands = rng.integers(0, 1000, size=(k, 3 * k)).astype(np.int32)
  arrays = index.device_arrays()
  device = jax.jit(ngram.interpolated)
  dev_ctx, dev_cands = jnp.asarray(context), jnp.asarray(cands)
  on_device, _ = median_time(lambda: device(arrays, dev_ctx, dev_cands).block_until_ready(), runs=20)
  on_host, _ = median_time(lambda: ngram.interpolated(index.arrays, context, cands, xp=np), runs=20)
  return on_device, on_host


def main(argv=None) -> int:
  args = parse_args(argv)
  model = load_model(args.model)
  start = time.perf_counter()
  index_dir = str(ensure_default_index(model.tokenizer, model.describe()))
  index = load_index(index_dir)
  print(f"n-gram index: {index.num_tokens:,} tokens, {index.nbytes / 2**20:.1f} MiB, build "
        f"{index.meta.get('build_seconds', float('nan'))} s (loaded in {time.perf_counter() - start:.1f} s), "
        f"corpora {index.meta.get('corpora')}")
  on_device, on_host = lookup_cost(index)
  print(f"look-ups per step (k=3, 9 candidates, orders 2-6): device {on_device * 1e3:.2f} ms, host "
        f"{on_host * 1e3:.2f} ms ({'device' if on_device < on_host else 'host'} faster, {jax.default_backend()})")
  ids = prefixes(model, args.prefixes, args.prefix)
  ks = [int(k) for k in args.drafts.split(",")]
  summary = {}
  for gen in (int(g) for g in args.lengths.split(",")):
    rows = run_length(model, index_dir, ids, gen, ks)
    med = {key: statistics.median(v) for key, v in rows.items()}
    print(f"\n## {len(ids)} prefixes of {args.prefix} tokens, {gen} generated tokens (median seconds / perplexity)")
    print(f"greedy {med['greedy']:.3f} s, ppl {med['ppl_greedy']:.2f}; nucleus ppl (mean of samples) "
          f"{med['ppl_nucleus']:.2f}")
    print("| k | SPD s | / greedy | / (k x greedy) | k nucleus one by one s | SPD / that | k nucleus batched s "
          "| SPD / that | ppl best of k | ppl draft 1 | best / nucleus |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in ks:
      def ratio(a, b, rows=rows):
        return statistics.median(x / y for x, y in zip(rows[a], rows[b], strict=True))
      line = dict(over_greedy=ratio(f"spd{k}", "greedy"), over_seq=ratio(f"spd{k}", f"nucleus_seq{k}"),
                  over_batch=ratio(f"spd{k}", f"nucleus_batch{k}"), ppl=ratio(f"ppl_best{k}", "ppl_nucleus"))
      summary[(gen, k)] = line
      print(f"| {k} | {med[f'spd{k}']:.3f} | {line['over_greedy']:.2f} | {line['over_greedy'] / k:.2f} | "
            f"{med[f'nucleus_seq{k}']:.3f} | "
            f"{line['over_seq']:.2f} | {med[f'nucleus_batch{k}']:.3f} | {line['over_batch']:.2f} | "
            f"{med[f'ppl_best{k}']:.2f} | {med[f'ppl_draft{k}_1']:.2f} | {line['ppl']:.2f} |")
  first = min(summary)[0]
  k3 = summary.get((first, 3)) or summary[min(summary)]
  print(f"RESULT time_k3_over_greedy={k3['over_greedy']:.3f} time_k3_over_nucleus3={k3['over_seq']:.3f} "
        f"ppl_best3_over_nucleus={k3['ppl']:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
