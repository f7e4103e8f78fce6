"""The answers a model writes itself for the prompts of a records file, as a new training pool (resumable).

  python -m train.self_answers --records runs/r/records/train.jsonl --out runs/self/answers.jsonl
                               [--model baseline-sft] [--batch-size 16] [--max-new-tokens 256]

The earlier PASTA paper annotates answers the model samples itself, so that the tagged model learns where to
fork in text it would write anyway, instead of in reference answers written in another voice. This writes,
for each record, the model's greedy answer (under the sampling defaults its folder ships, as `pasta generate`
decodes it) in `output`, the record's own answer in `reference`, and where it came from in `answer_source`.
`python -m train.recipe --pools <out> --stages records,...` then annotates and fits them as any pool.

An answer cut at --max-new-tokens, or an empty one, is not kept (a model trained on a cut one would learn to
stop mid-sentence); the report (`<out>.report.json`) counts them. Each batch is appended when it is done, so a
killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from pasta_jax.data.encode import record_prompt
from pasta_jax.errors import PastaError
from pasta_jax.model import runfiles
from train.common import run_main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="train.self_answers", description=__doc__.split("\n\n")[0])
  parser.add_argument("--records", required=True, help="a JSONL of instruction records (instruction, input, output)")
  parser.add_argument("--out", required=True, help="the JSONL to write (resumed when it exists)")
  parser.add_argument("--model", default="baseline-sft", help="the model that answers (default: baseline-sft)")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--limit", type=int, default=None, help="the first N records only")
  return parser.parse_args(argv)


def answer_rows(records: list[dict], results, source: str) -> tuple[list[dict], list[dict]]:
  """(kept rows, cut rows): a record answered by its result; an answer cut at the budget is not kept."""
  kept, cut = [], []
  for record, result in zip(records, results, strict=True):
    row = {**record, "output": result.text.strip(), "reference": record.get("output", ""), "answer_source": source}
    row.pop("annotated", None)
    (cut if result.truncated or not row["output"] else kept).append(row)
  return kept, cut


def main(argv=None) -> int:
  args = parse_args(argv)
  from pasta_jax.decode.sampling import SamplingConfig
  from pasta_jax.methods import generate
  from pasta_jax.model.load import generation_defaults, load_model

  records = [value for _, value in runfiles.iter_jsonl(Path(args.records), PastaError)][:args.limit]
  out, report_path = Path(args.out), Path(args.out + ".report.json")
  written = list(runfiles.read_rows(out))  # cuts a torn last line (a kill mid-append): that batch runs again
  earlier = runfiles.read_json_file(report_path) if report_path.is_file() and written else {}
  report = {"kept": len(written), "cut": earlier.get("cut", [])}
  seen = {row["id"] for row in written} | set(report["cut"])
  todo = [r for r in records if r["id"] not in seen]
  model = load_model(args.model)
  penalty = float(generation_defaults(model).get("repetition_penalty", 1.0))
  sampling = SamplingConfig(repetition_penalty=penalty)
  source = f"{args.model} greedy, repetition penalty {penalty:g}, at most {args.max_new_tokens} tokens"
  out.parent.mkdir(parents=True, exist_ok=True)
  with tqdm(total=len(records), initial=len(records) - len(todo), desc="answers") as bar:
    for start in range(0, len(todo), args.batch_size):
      batch = todo[start:start + args.batch_size]
      results = generate(model, [record_prompt(r) for r in batch], "sequential",
                         max_new_tokens=args.max_new_tokens, sampling=sampling)
      kept, cut = answer_rows(batch, results, source)
      runfiles.append_rows(out, kept)
      report["kept"] += len(kept)
      report["cut"] += [row["id"] for row in cut]
      runfiles.write_json(report_path, {**report, "source": source})
      bar.update(len(batch))
  print(f"{report['kept']} answers kept, {len(report['cut'])} cut at {args.max_new_tokens} tokens or empty -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(run_main(main))
