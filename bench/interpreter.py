"""Forced-replay speed of the interleaved PASTA interpreter on the real Gemma 3 270M (CPU, greedy, batch 1).

LIMA answers (truncated to their first ~200 tokens) are annotated structurally (list items ->
blocks, `pasta_jax.data.structural`). For each answer:
  - realized speedup: time(tag-free twin replayed sequentially) / time(annotated answer replayed),
    both through the same interleaved interpreter, against the theoretical speedup of the trace;
  - sequential overhead: the twin's step time / a plain decode's step time (`method="sequential"`, the
    same twin replayed, same prompt), both net of prefill: plain decoding is timed at two lengths, the
    slope is its step time and the intercept the prefill, which is taken off the twin's time too;
  - naive vs interleaved (`decode.naive`, same scripts): time ratio and KV-pool bytes ratio.
Every time is the second of two runs (the first compiles and warms up). Prompts are kept to one
shape bucket so each loop compiles once.

  python -m bench.interpreter [--limit 24] [--answer-tokens 200] [--lanes 8]
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from bench.common import plain_step, second_of_two, table
from bench.replay import add_replay_flags, first, replay_answers
from pasta_jax.data.structural import annotate
from pasta_jax.decode import api, naive
from pasta_jax.errors import TagError
from pasta_jax.lang.metrics import geometric_mean
from pasta_jax.lang.text import strip_tags
from pasta_jax.methods import Pasta, generate
from pasta_jax.model.load import load_model

DATA = "lima"  # a shared dataset name or a JSONL path


def candidates(model, path: str, answer_tokens: int, prompt_bucket: int, limit: int):
  """(id, prompt, prompt ids, annotated answer) for LIMA answers that get at least one block."""
  lang_tok = api.LangTokenizer(model.tokenizer)
  vocab = model.tokenizer.tag_vocab()

  def forkable():
    for answer_id, prompt, ids, answer in replay_answers(model, path, answer_tokens, prompt_bucket):
      annotated = annotate(answer, lambda s: len(lang_tok.encode(s)))
      if annotated is not None and replayable(annotated, lang_tok, vocab):
        yield answer_id, prompt, ids, annotated

  return first(forkable(), limit, f"no answer in {path} has a prompt of padded length {prompt_bucket} and a "
                                  "block to fork")


def replayable(annotated: str, lang_tok, vocab) -> bool:
  try:
    api.forced_scripts(annotated, lang_tok, vocab)
  except TagError:
    return False
  return True


def measure(model, prompt, ids, annotated, args) -> dict:
  method = Pasta(lanes=args.lanes)
  twin_text = strip_tags(annotated)
  ann = second_of_two(lambda: generate(model, [prompt], method, forced_answers=[annotated],
                                       max_new_tokens=args.new_tokens)[0])
  twin = second_of_two(lambda: generate(model, [prompt], method, forced_answers=[twin_text],
                                        max_new_tokens=args.new_tokens)[0])

  # Two plain lengths give the per-step slope and the prefill (intercept), so the twin's step time is
  # taken net of prefill too, however many steps its answer needs.
  step, prefill = plain_step(model, ids, twin_text, max_new_tokens=args.new_tokens)
  lang_tok = api.LangTokenizer(model.tokenizer)
  scripts = [api.forced_scripts(annotated, lang_tok, model.tokenizer.tag_vocab())]
  prep = api.prepare(model, [ids], scripts=scripts, max_new_tokens=args.new_tokens, lanes=args.lanes)
  naive_runs, naive_seconds = second_of_two(lambda: api.run_prepared(prep, runner=naive.naive_prefill_and_run))
  naive_bytes = naive.naive_kv_bytes(prep.cfg, 1, prep.pool_spec)
  interleaved_bytes = naive.interleaved_kv_bytes(prep.cfg, 1, prep.pool_spec)
  ok = ann.finished and twin.finished and naive_runs[0].finished and ann.text == twin.text == twin_text
  return dict(
      tokens=twin.content_tokens, blocks=len(ann.threads) - 1, steps=ann.steps, twin_steps=twin.steps,
      stalls=ann.stalls, t_ann=ann.seconds, t_twin=twin.seconds, realized=twin.seconds / ann.seconds,
      theoretical=ann.theoretical_speedup,
      seq_overhead=((twin.seconds - prefill) / twin.steps) / step,
      naive_time=naive_seconds / ann.seconds, naive_kv=naive_bytes / interleaved_bytes, ok=ok)


COLUMNS = ("id", "tokens", "blocks", "steps", "twin_steps", "stalls", "t_ann", "t_twin", "realized", "theoretical",
           "seq_overhead", "naive_time", "naive_kv", "ok")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.interpreter", description=__doc__.split("\n\n")[0])
  add_replay_flags(parser, limit=24, data=DATA)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  model = load_model(args.model or "base")
  items = list(candidates(model, args.data, args.answer_tokens, args.prompt_bucket, args.limit))
  rows = []
  for answer_id, prompt, ids, annotated in tqdm(items, desc="answers"):
    rows.append(dict(id=answer_id, **measure(model, prompt, ids, annotated, args)))
  print(table(rows, COLUMNS))
  means = {k: geometric_mean(r[k] for r in rows) for k in ("realized", "theoretical", "seq_overhead", "naive_time",
                                                            "naive_kv")}
  print("geometric means: " + ", ".join(f"{k}={v:.3f}" for k, v in means.items()) +
        f"; {sum(r['ok'] for r in rows)}/{len(rows)} replays finished with identical clean text")
  print(f"RESULT realized_over_theoretical={means['realized'] / means['theoretical']:.3f} "
        f"seq_overhead={means['seq_overhead']:.3f} naive_time_ratio={means['naive_time']:.3f} "
        f"naive_kv_ratio={means['naive_kv']:.3f}")


if __name__ == "__main__":
  main()
