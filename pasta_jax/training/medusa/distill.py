"""Self-distillation data: the model's own greedy answers to training-pool prompts (Medusa-2's advice for
models whose training data is not at hand), as rows of token ids, one JSON line each: written by `distill`,
read back, split into training and held-out rows, and batched for the frozen base.

distill.jsonl is appended one batch at a time (`runfiles.append_rows`: a row a kill tore is cut first). A resume
keeps the rows of whole batches only and samples from the next batch boundary, so every batch decodes the same
prompts together as an uninterrupted run (the same float rounding, the same answers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from pasta_jax.data.sources import read_records
from pasta_jax.errors import PastaError
from pasta_jax.model import runfiles

POOLS = ("lima", "alpaca_gpt4_1k", "alpaca_5k")  # training pools; alpaca_eval_805 stays held out


def prompts_from_pools(count: int) -> list[str]:
  """The first `count` distinct instructions, taken round-robin from the training pools."""
  per_pool = [read_records(p) for p in POOLS]
  out, seen = [], set()
  for i in range(max(len(r) for r in per_pool)):
    for records in per_pool:
      if i < len(records):
        text = records[i]["instruction"] + (("\n\n" + records[i]["input"]) if records[i].get("input") else "")
        if text not in seen:
          seen.add(text)
          out.append(text)
      if len(out) == count:
        return out
  return out


def answer_ids(result, eos_ids) -> list[int]:
  """The answer's token ids, up to (not including) its end id."""
  out = []
  for token in result.records[:, 3].tolist():
    if token in eos_ids:
      break
    out.append(int(token))
  return out


def distill(model, out: Path, count: int, batch: int, new_tokens: int) -> Path:
  """Greedy answers of `model` to `count` pool prompts, appended per batch to distill.jsonl (resumes)."""
  from pasta_jax.decode.api import prompt_ids
  from pasta_jax.decode.runtime import Runtime
  from pasta_jax.methods import Sequential, generate_ids
  path = out / "distill.jsonl"
  prompts = prompts_from_pools(count)
  rows = list(runfiles.read_rows(path))
  for i, row in enumerate(rows[:len(prompts)]):
    if row.get("prompt") != prompts[i]:
      raise PastaError(f"{path}: row {i + 1} answers another prompt than the pools' {i + 1}th; use another --out")
  done = len(rows) - len(rows) % batch  # whole batches only (module doc)
  if done < len(rows):
    runfiles.write_rows(path, rows[:done])
  eos = set(model.tokenizer.eos_ids) if hasattr(model.tokenizer, "eos_ids") else None
  with tqdm(total=len(prompts), initial=min(done, len(prompts)), desc="distill (greedy answers)") as bar:
    for start in range(done, len(prompts), batch):
      texts = prompts[start:start + batch]
      ids = prompt_ids(model.tokenizer, texts, chat=True)
      # the certified head: float32 greedy's tokens at the narrow head's cost (decode/certified_head.py)
      results = generate_ids(model, ids, Sequential(), max_new_tokens=new_tokens, runtime=Runtime(certify_head=True))
      ends = eos if eos is not None else set()
      runfiles.append_rows(path, [{"prompt": text, "prompt_ids": prompt, "answer_ids": answer_ids(result, ends),
                                   "finished": result.finished} for text, prompt, result in zip(texts, ids, results)])
      bar.update(len(texts))
  return path


def read_distilled(path: Path) -> list[dict]:
  """The rows of distill.jsonl with answers long enough to train on (4 tokens or more)."""
  return [r for r in runfiles.read_rows(path) if len(r["answer_ids"]) >= 4]


def split(rows: list[dict], held_out: float) -> tuple[list[dict], list[dict]]:
  """A fixed split: every k-th row is held out for calibration (k = 1 / held_out)."""
  every = max(2, round(1 / held_out))
  return [r for i, r in enumerate(rows) if i % every], [r for i, r in enumerate(rows) if i % every == 0]


def padded_batches(rows: list[dict], batch: int, desc: str):
  """Yields (rows, their prompt + answer ids, tokens [b, bucketed L] zero-padded, lengths) per `batch` rows."""
  from pasta_jax.decode.loop import bucket
  for start in tqdm(range(0, len(rows), batch), desc=desc):
    chunk = rows[start:start + batch]
    seqs = [np.asarray(r["prompt_ids"] + r["answer_ids"]) for r in chunk]
    tokens = np.zeros((len(seqs), bucket(max(map(len, seqs)))), np.int32)
    for i, seq in enumerate(seqs):
      tokens[i, :len(seq)] = seq
    yield chunk, seqs, tokens, [len(q) for q in seqs]
