"""`pasta ngram build`: the n-gram index Superposed Decoding smooths its drafts with."""

from __future__ import annotations

from pasta_jax.data.ngram_corpus import DEFAULT_CORPUS
from pasta_jax.decode.ngram import default_index_dir


def add_ngram_parser(subparsers) -> None:
  ngram = subparsers.add_parser("ngram", help="n-gram index for Superposed Decoding")
  sub = ngram.add_subparsers(dest="ngram_command", required=True)
  build = sub.add_parser("build", help="tokenize a corpus and index its n-grams (n <= 6)")
  build.add_argument("corpus", nargs="*", default=list(DEFAULT_CORPUS),
                     help="shared data names, JSONL or .txt files (default: the training pools)")
  build.add_argument("--out", default=None, help=f"index folder (default: {default_index_dir()})")
  build.add_argument("--model", default="base", help="whose tokenizer (default: the embedded Gemma 3 270M)")


def run_ngram(args) -> int:
  from pasta_jax.data.ngram_corpus import build_index
  from pasta_jax.model.load import load_model

  model = load_model(args.model)
  index = build_index(args.corpus, model.tokenizer, tokenizer_name=model.describe())
  folder = index.save(args.out or default_index_dir())
  print(f"n-gram index: {index.meta['tokens']:,} tokens in {index.meta['documents']:,} documents from "
        f"{', '.join(args.corpus)}; {index.nbytes / 2**20:.1f} MiB; built in {index.meta['build_seconds']} s "
        f"-> {folder}")
  return 0
