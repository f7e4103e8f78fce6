"""Text corpora for Superposed Decoding's n-gram index (`decode.ngram`): documents -> token ids -> index.

A corpus is a shared data name or a JSONL file (each record's instruction, input and answer are
documents) or a .txt file (paragraphs separated by blank lines are documents). The default is the
training pools; `alpaca_eval_805` is the evaluation set and is refused, so no eval answer leaks in.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from pasta_jax.data.sources import DataError, read_records
from pasta_jax.decode.ngram import NgramIndex, default_index_dir

DEFAULT_CORPUS = ("lima", "alpaca_gpt4_1k", "alpaca_5k")
EVAL_SETS = ("alpaca_eval_805", "mt_bench_questions")


def documents(corpus: str) -> list[str]:
  if Path(corpus).stem in EVAL_SETS:
    raise DataError(f"{corpus} is an evaluation set: an n-gram index built from it would leak its answers")
  if corpus.endswith(".txt"):
    try:
      text = Path(corpus).read_text(encoding="utf-8")
    except OSError as err:
      raise DataError(f"cannot read corpus {corpus}: {err.strerror}") from None
    return [p.strip() for p in text.split("\n\n") if p.strip()]
  docs = []
  for record in read_records(corpus):
    docs += [record[f] for f in ("instruction", "input", "output") if record.get(f, "").strip()]
  return docs


def tokenized(corpora: Sequence[str], tokenizer, progress: bool = True) -> Iterator[list[int]]:
  for corpus in corpora:
    for doc in tqdm(documents(corpus), desc=f"tokenize {corpus}", unit="doc", disable=not progress):
      yield tokenizer.encode(doc, add_bos=False)


def build_index(corpora: Sequence[str], tokenizer, tokenizer_name: str, max_n: int = 6,
                progress: bool = True) -> NgramIndex:
  start = time.perf_counter()
  index = NgramIndex.build(tokenized(corpora, tokenizer, progress), max_n=max_n,
                           meta={"corpora": list(corpora), "tokenizer": tokenizer_name})
  index.meta["build_seconds"] = round(time.perf_counter() - start, 2)
  return index


def ensure_default_index(tokenizer, tokenizer_name: str) -> Path:
  """The default index folder, built from the training pools first if it is missing (~5 s here)."""
  folder = default_index_dir()
  if not (folder / "index.json").is_file():
    print(f"[building the n-gram index of {', '.join(DEFAULT_CORPUS)} in {folder}, once]", file=sys.stderr)
    build_index(DEFAULT_CORPUS, tokenizer, tokenizer_name, progress=False).save(folder)
  return folder
