"""`pasta annotate`: make Pasta-SFT (or APAR-format) data from a dataset.

  pasta annotate lima --out data/lima_llm.jsonl --with llm          # PASTA_ANNOTATOR_* endpoint, resumable
  pasta annotate lima --out data/lima_struct.jsonl --with structural --verify   # + the model-verified filter
  pasta annotate lima --out data/lima_apar.jsonl --with apar        # APAR's rules (ordered lists, paragraphs)
Rows are the records with `annotated` (promise form) or `apar` (APAR text form) added, plus the reason
when an answer got none; `train.sft --data <file>` reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from pasta_jax.errors import ConfigError


def add_annotate_parser(subparsers) -> None:
  parser = subparsers.add_parser("annotate", help="annotate a dataset (structural, LLM or APAR format)")
  parser.add_argument("data", help="a shared dataset name or a JSONL path")
  parser.add_argument("--out", required=True, help="output JSONL")
  parser.add_argument("--with", dest="kind", choices=list(ANNOTATORS), default="structural")
  parser.add_argument("--verify", action="store_true", help="keep only annotations the local model verifies")
  parser.add_argument("--model", default=None, help="model for --verify (default: the embedded Gemma 3 270M)")
  parser.add_argument("--concurrency", type=int, default=4, help="parallel LLM requests")
  parser.add_argument("--allow-http-key", action="store_true",
                      help="--with llm: send PASTA_ANNOTATOR_API_KEY over plain http:// to a host that is not "
                           "loopback (refused by default: anyone on the path could read the key)")
  parser.add_argument("--limit", type=int, default=None)


def run_annotate(args) -> int:
  from pasta_jax.data import sources
  records = sources.read_records(args.data, args.limit)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  rows, field = ANNOTATORS[args.kind](records, args, out)
  if args.verify:
    rows = _verified(rows, args.model)
  with open(out, "w") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  print(f"{sum(bool(r.get(field)) for r in rows)}/{len(rows)} records annotated -> {out}")
  return 0


def _apar_rows(records, args, out: Path) -> tuple[list[dict], str]:
  from pasta_jax.data.apar_format import apar_records
  rows, kinds = apar_records(records)
  print(f"APAR format: {dict(kinds)}")
  return rows, "apar"


def _pasta_rows(records, args, out: Path) -> tuple[list[dict], str]:
  """(rows with `annotated` in promise form, its field): by the structural rules or the LLM annotator."""
  return _promise_rows(records, args, out), "annotated"


def _promise_rows(records, args, out: Path) -> list[dict]:
  from pasta_jax.commands.data_stats import load_tokenizer
  from pasta_jax.data import llm_annotator
  from pasta_jax.decode.api import LangTokenizer
  client = None
  if args.kind == "llm":  # a misconfigured endpoint is named before the tokenizer loads
    client = llm_annotator.client_from_env(allow_insecure_key=args.allow_http_key)
  lang = LangTokenizer(load_tokenizer())
  count = lambda text: len(lang.encode(text))  # noqa: E731
  if args.kind == "structural":
    from pasta_jax.data.structural import annotate
    return [{**r, "annotated": annotate(r["output"], count)} for r in tqdm(records, desc="annotating")]
  progress_file = out.with_suffix(".progress.jsonl")  # resumable: one row per record id
  counts = llm_annotator.annotate_file(records, client, progress_file, count, concurrency=args.concurrency)
  print(f"LLM annotator: {counts}")
  from pasta_jax.model.runfiles import read_rows
  done = {row["id"]: row for row in read_rows(progress_file)}
  return [{**r, "annotated": done[str(r["id"])]["annotated"], "reason": done[str(r["id"])]["reason"]}
          for r in records]


def _verified(rows: list[dict], model_path: str | None) -> list[dict]:
  from pasta_jax.data.encode import record_prompt
  from pasta_jax.data.verify import verify
  from pasta_jax.model.load import load_model
  if not any(r.get("annotated") for r in rows):
    raise ConfigError("--verify checks PASTA annotations; none were made")
  model = load_model(model_path or "base")
  out = []
  for row in tqdm(rows, desc="verifying"):
    if row.get("annotated"):
      verdict = verify({"instruction": record_prompt(row), "annotated": row["annotated"]}, model)
      if not verdict.keep:
        row = {**row, "annotated": None, "reason": f"model-verified filter: {verdict.reason}"}
    out.append(row)
  return out


# annotator -> (records, args, out) -> (rows, the field its annotations are in)
ANNOTATORS = {"structural": _pasta_rows, "llm": _pasta_rows, "apar": _apar_rows}
