"""PASTA, APAR and sequential decoding of the same answers, side by side, on the real Gemma 3 270M.

LIMA answers (first ~200 tokens) that both formats can structure are replayed (forced) three ways
through the one interpreter, greedy, batch 1, timing the second of two runs:
  - PASTA: the structural annotation (list items -> blocks, data/structural.py);
  - APAR: the APAR-format annotation (ordered lists / paragraphs, data/apar_format.py);
  - sequential: the tag-free answer on one lane.
Per answer: realized speedup (sequential time / method time), theoretical speedup, and peak live
KV slots (the prompt included; APAR releases finished children, PASTA keeps forks for the sync).

  python -m bench.baselines [--limit 20] [--answer-tokens 200] [--lanes 8]
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from bench.common import second_of_two, table
from bench.interpreter import DATA
from bench.replay import add_replay_flags, first, replay_answers
from pasta_jax.data.apar_format import apar_annotate
from pasta_jax.data.structural import annotate
from pasta_jax.decode import api
from pasta_jax.decode.apar_text import encode_apar_text
from pasta_jax.errors import TagError
from pasta_jax.lang.metrics import geometric_mean
from pasta_jax.methods import Apar, Pasta, generate
from pasta_jax.model.load import load_model


def candidates(model, path: str, answer_tokens: int, prompt_bucket: int, limit: int):
  """(id, prompt, plain answer, PASTA annotation, APAR annotation) for answers both can structure."""
  lang = api.LangTokenizer(model.tokenizer)
  vocab = model.tokenizer.tag_vocab()

  def structured():
    for answer_id, prompt, _, plain in replay_answers(model, path, answer_tokens, prompt_bucket):
      pasta = annotate(plain, lambda s: len(lang.encode(s)))
      apar = apar_annotate(plain).annotated
      if pasta is not None and apar is not None and both_replayable(pasta, apar, lang, vocab):
        yield answer_id, prompt, plain, pasta, apar

  return first(structured(), limit, f"no answer in {path} has a prompt of padded length {prompt_bucket} that "
                                    "both formats can structure")


def both_replayable(pasta: str, apar: str, lang, vocab) -> bool:
  try:
    api.forced_scripts(pasta, lang, vocab)
    encode_apar_text(apar, lang, vocab)
  except TagError:
    return False
  return True


def measure(model, prompt, plain, pasta, apar, args) -> dict:
  kw = dict(max_new_tokens=args.new_tokens)
  pasta_method, apar_method = Pasta(lanes=args.lanes), Apar(lanes=args.lanes)
  seq = second_of_two(lambda: generate(model, [prompt], pasta_method, forced_answers=[plain], **kw)[0])
  par = second_of_two(lambda: generate(model, [prompt], pasta_method, forced_answers=[pasta], **kw)[0])
  tree = second_of_two(lambda: generate(model, [prompt], apar_method, forced_answers=[apar], **kw)[0])
  ok = seq.finished and par.finished and tree.finished and par.text == tree.text == seq.text == plain
  return dict(tokens=seq.content_tokens, pasta_forks=len(par.threads) - 1, apar_forks=len(tree.thread_texts) - 1,
              pasta_speedup=seq.seconds / par.seconds, pasta_theory=par.theoretical_speedup,
              apar_speedup=seq.seconds / tree.seconds, apar_theory=tree.theoretical_speedup,
              seq_peak=_written(seq), pasta_peak=_written(par), apar_peak=tree.peak_live_slots,
              ok=ok)


def _written(result) -> int:
  """Peak live slots of a PASTA-mode run, which never releases: the prompt plus every token written
  (every record but main's final end id)."""
  return int(result.records[0, 4]) + len(result.records) - 1


COLUMNS = ("id", "tokens", "pasta_forks", "apar_forks", "pasta_speedup", "pasta_theory", "apar_speedup",
           "apar_theory", "seq_peak", "pasta_peak", "apar_peak", "ok")


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.baselines", description=__doc__.split("\n\n")[0])
  add_replay_flags(parser, limit=20, data=DATA)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  model = load_model(args.model or "base")
  items = list(candidates(model, args.data, args.answer_tokens, args.prompt_bucket, args.limit))
  rows = [dict(id=i, **measure(model, p, plain, pasta, apar, args))
          for i, p, plain, pasta, apar in tqdm(items, desc="answers")]
  print(table(rows, COLUMNS, width=13))
  g = {k: geometric_mean(r[k] for r in rows) for k in ("pasta_speedup", "pasta_theory", "apar_speedup", "apar_theory")}
  peak_ratio = geometric_mean(r["apar_peak"] / r["seq_peak"] for r in rows)
  pasta_peak_ratio = geometric_mean(r["pasta_peak"] / r["seq_peak"] for r in rows)
  print(f"geometric means over {len(rows)} answers: " + ", ".join(f"{k}={v:.3f}" for k, v in g.items()) +
        f", apar_peak/seq_peak={peak_ratio:.3f}, pasta_peak/seq_peak={pasta_peak_ratio:.3f}; "
        f"{sum(r['ok'] for r in rows)}/{len(rows)} replays finished with identical clean text; "
        f"APAR peak below sequential on {sum(r['apar_peak'] < r['seq_peak'] for r in rows)}/{len(rows)}")
  print(f"RESULT pasta_speedup={g['pasta_speedup']:.3f} apar_speedup={g['apar_speedup']:.3f} "
        f"apar_peak_kv_ratio={peak_ratio:.3f}")


if __name__ == "__main__":
  main()
