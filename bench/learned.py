"""The shipped PASTA model in free decoding against the shipped Baseline-SFT (CPU or any device).

Both models decode freely (nothing forced), greedy, batch 1, through the same interpreter, each prompt
twice with the second run timed (`pasta eval`'s runner: resumable, a report and a Pareto plot in
--out). Realized speedup per prompt = Baseline-SFT seconds / PASTA seconds (different answers, as the
paper measures it); theoretical = Baseline-SFT content tokens / the PASTA answer's critical path.
Then what the model wrote: fork rate, well-formed tags, truncation, duplicate blocks, and quality
proxies (ROUGE-L against the reference answer, log p per token under Baseline-SFT; `--judge local`
adds the local pairwise judge, which is weak: see the report's note).

  python -m bench.learned [--limit 100] [--prompts alpaca_eval_805|mt_bench_questions|FILE]
                          [--model pasta] [--baseline baseline-sft] [--out runs/learned]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from pasta_jax.commands.eval import make_judge
from pasta_jax.data import sources
from pasta_jax.eval import methods as M
from pasta_jax.eval.learned import figure_lines, learned_figures, result_line
from pasta_jax.eval.quality import answer_logprob
from pasta_jax.eval.report import speed_table, write_outputs
from pasta_jax.eval.runner import evaluate


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.learned", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", default="alpaca_eval_805", help="shared dataset name or JSONL (instruction/turns)")
  parser.add_argument("--limit", type=int, default=100)
  parser.add_argument("--model", default=None, help="the PASTA model (default: the shipped tuned default)")
  parser.add_argument("--baseline", default="baseline-sft", help="the Baseline-SFT model (default: the shipped one)")
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--judge", default="none", metavar="none|local[:MODEL]|http")
  parser.add_argument("--no-logprob", dest="logprob", action="store_false",
                      help="skip the log-likelihood proxy (one Baseline-SFT forward per answer)")
  parser.add_argument("--out", default="runs/learned", help="run folder (resumed if it holds the same run)")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  records = sources.read_records(args.prompts, args.limit)
  settings = M.DecodeSettings(max_new_tokens=args.max_new_tokens, lanes=args.lanes, chat=True)
  model, baseline_model = M.cached_model(args.model), M.cached_model(args.baseline)
  print(f"PASTA model: {model.describe()}\nBaseline:    {baseline_model.describe()}")
  method = M.InterpreterMethod(f"pasta:{args.model or 'default'}", model, settings)
  baseline = M.InterpreterMethod(f"sequential:{args.baseline}", baseline_model, settings)
  out = Path(args.out)
  judge, note = make_judge(args.judge, out)
  identity = dict(prompts=sources.dataset_name(args.prompts), model=model.source, baseline=baseline_model.source,
                  **vars(settings))
  results = evaluate(records, baseline, [method], out, identity=identity, judge=judge, judge_note=note)
  results["settings"].update(baseline=baseline.name, methods=[method.name], limit=args.limit)
  paths = write_outputs(results, out)
  scorer = None
  if args.logprob:
    bar = tqdm(total=2 * len(records), desc="log p under Baseline-SFT")
    scorer = lambda prompt, text: (bar.update(1), answer_logprob(baseline_model, prompt, text)[0])[1]
  figures = learned_figures(results, records, method.name, baseline.name, scorer)
  (out / "learned.json").write_text(json.dumps(figures, indent=1))
  lines = figure_lines(figures)
  (out / "learned.md").write_text("\n".join(["# bench.learned", "", *lines, ""]))
  print("\n".join(speed_table(results)))
  print("\n".join(lines))
  print("wrote " + ", ".join(str(p) for p in [*paths, out / "learned.md"]))
  print(result_line(figures))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
