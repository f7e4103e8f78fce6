"""Answer a file of prompts in batches with any method; one JSON line per answer, resumable.

  python -m infer.generate --prompts alpaca_eval_805 --out runs/answers.jsonl [--limit 20] [--method pasta]
                           [--model pasta-bon] [--batch-size 4] [--max-new-tokens 256] [--temperature 0.7 --seed 1]

Prompts: a shared dataset name or any instruction JSONL (`pasta_jax.data.sources`: alpaca, alpaca_eval or
mt_bench shapes). Each answer line holds the prompt's id and instruction, the method, the answer's text (tags
hidden), its tokens, steps and how it stopped. Killed and started again with the same flags, it answers only the
prompts not yet in `--out`; other flags than those of the file's first run are refused. For one prompt with its
thread chart, `python -m infer.generate "..."` is `pasta generate "..."`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pasta_jax import cli
from pasta_jax.errors import PastaError
from pasta_jax.model import runfiles

SETTINGS_FIELDS = ("prompts", "model", "method", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "chat")


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="infer.generate", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", required=True, help="a shared dataset name (alpaca_eval_805, ...) or a JSONL path")
  parser.add_argument("--out", required=True, help="the answers' JSONL (appended to; a rerun resumes it)")
  parser.add_argument("--model", default=None, help="as `pasta generate --model` (default: the tuned default)")
  parser.add_argument("--method", default=None, help="a method name (default: the model's generation.json)")
  parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                      help="wrap each prompt in Gemma's chat turns (default: on)")
  args = parser.parse_args(argv)
  if args.batch_size < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
    parser.error("--batch-size, --max-new-tokens and --limit must be at least 1")
  return args


def answered(out: Path) -> set[str]:
  """Ids already answered in `out` (a torn last line, from a kill mid-write, is cut)."""
  return {row["id"] for row in runfiles.read_rows(out) if "id" in row} if out.is_file() else set()


def check_same_settings(out: Path, settings: dict) -> None:
  """The first run writes its settings beside `out`; a rerun with others is refused (its answers would mix)."""
  path = out.with_name(out.name + ".settings.json")
  if path.is_file():
    runfiles.check_settings(runfiles.read_json_file(path), settings, str(out), error=PastaError)
  else:
    out.parent.mkdir(parents=True, exist_ok=True)
    runfiles.write_json(path, settings)


def answer_row(record: dict, result, method: str) -> dict:
  return {"id": record["id"], "instruction": record["instruction"], "method": method, "text": result.text,
          "tokens": int(len(result.records)), "steps": int(result.steps), "stop_reason": result.stop_reason}


def run(args: argparse.Namespace) -> int:
  from tqdm import tqdm

  from pasta_jax.data.sources import read_records
  from pasta_jax.decode.sampling import SamplingConfig
  from pasta_jax.methods import generate, registry
  from pasta_jax.model.load import generation_defaults, load_model

  sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
  records = read_records(args.prompts, max_records=args.limit)
  out = Path(args.out)
  check_same_settings(out, {k: getattr(args, k) for k in SETTINGS_FIELDS})
  done = answered(out)
  todo = [r for r in records if r["id"] not in done]
  print(f"[{len(done)} of {len(records)} prompts already answered in {out}]", file=sys.stderr)
  if not todo:
    return 0
  model = load_model(args.model)
  name = args.method or generation_defaults(model).get("method") or "sequential"
  if name not in registry.METHODS:
    raise PastaError(f"unknown method {name!r}; use one of {', '.join(registry.METHODS)}")
  with tqdm(total=len(records), initial=len(done), unit="prompt", desc=f"{name} answers") as bar:
    for start in range(0, len(todo), args.batch_size):
      batch = todo[start:start + args.batch_size]
      prompts = [r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "") for r in batch]
      results = generate(model, prompts, name, max_new_tokens=args.max_new_tokens, sampling=sampling,
                         chat=args.chat)
      runfiles.append_rows(out, [answer_row(r, res, name) for r, res in zip(batch, results)])
      bar.update(len(batch))
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and not argv[0].startswith("-") and "--prompts" not in argv:  # one prompt: `pasta generate`
    return cli.main(["generate", *argv])
  try:
    return run(parse_args(argv))
  except PastaError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
