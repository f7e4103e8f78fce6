"""`pasta eval`: speed (and, with a judge, quality) of decoding methods against a baseline.

  pasta eval --limit 20 --methods pasta-forced --out runs/eval20
  pasta eval --methods pasta:runs/sft/model --baseline sequential:runs/baseline_sft/model --judge http --out ...

Writes results.json, report.md and pareto.png to --out; rerunning with the same --out resumes. This
module imports only argparse at the top, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def build_eval_parser(subparsers) -> argparse.ArgumentParser:
  parser = subparsers.add_parser("eval", help="speed and quality of decoding methods against a baseline",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", default="alpaca_eval_805",
                      help="alpaca_eval_805 (default), mt_bench (first turns), or any instruction JSONL")
  parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts only")
  parser.add_argument("--methods", nargs="+", default=["pasta-forced"], metavar="NAME[:MODEL]",
                      help="methods to compare: every decoding method (pasta, sequential, pasta-v0, apar, "
                           "superposed, medusa, propd, pasta+medusa), NAME-forced for those that annotate (pasta, "
                           "sequential, pasta-v0, apar), and sot, sot-router, sot-forced (default: pasta-forced); "
                           "an unknown name is refused with the list")
  parser.add_argument("--baseline", default="sequential", metavar="NAME[:MODEL]",
                      help="what methods without their own reference are measured against (default: sequential)")
  parser.add_argument("--model", default=None,
                      help="model of methods named without one (default: the tuned default, pasta-bon)")
  parser.add_argument("--out", required=True, help="output folder (resumed if it holds the same run)")
  parser.add_argument("--max-new-tokens", type=int, default=256,
                      help="content-token budget of free decodes; forced answers are cut to this many tokens")
  parser.add_argument("--lanes", type=int, default=8, help="interpreter lanes (lane 0 is main)")
  parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                      help="wrap prompts in Gemma chat turns, as SFT trains (default on)")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  parser.add_argument("--repetition-penalty", type=float, default=1.0,
                      help="greedy under CTRL's repetition penalty, for every method and the baseline (1 = off)")
  parser.add_argument("--distinct-topics", action="store_true",
                      help="PASTA's main may not close a promise on a topic it already used (decode.sampling)")
  parser.add_argument("--certify-head", action="store_true",
                      help="every method's greedy choices certified against the float32 head at a narrow head's "
                           "cost (int8 on a CPU; decode/certified_head.py): the same answers, faster steps of 2-3 rows")
  parser.add_argument("--judge", default="auto", metavar="auto|none|http|local[:MODEL]",
                      help="pairwise judge for quality; auto = http if PASTA_JUDGE_BASE_URL is set, else none")
  parser.add_argument("--allow-http-key", action="store_true",
                      help="let the http judge send PASTA_JUDGE_API_KEY over plain http:// to a host that is not "
                           "loopback (refused by default: anyone on the path could read the key)")
  parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
  return parser


def run_eval(args) -> int:
  from pasta_jax.commands import eval_registry as registry
  from pasta_jax.data import sources
  from pasta_jax.eval import methods as M
  from pasta_jax.eval.report import speed_table, write_outputs
  from pasta_jax.eval.runner import evaluate
  from pasta_jax.judges.factory import make_judge

  check_numbers(args)
  baseline_spec = registry.parse_spec(args.baseline)
  specs = [registry.parse_spec(text) for text in args.methods]
  records = sources.read_records(args.prompts, args.limit)
  settings = M.DecodeSettings(max_new_tokens=args.max_new_tokens, lanes=args.lanes, chat=args.chat, dtype=args.dtype,
                              repetition_penalty=args.repetition_penalty, distinct_topics=args.distinct_topics,
                              certify_head=args.certify_head)
  identity = dict(prompts=sources.dataset_name(args.prompts), model=args.model, **settings.identity())
  out = Path(args.out)
  load = lambda path: M.cached_model(path)
  judge, judge_note = make_judge(args.judge, out, load, allow_http_key=args.allow_http_key)
  baseline = registry.build_method(baseline_spec, settings, load, args.model)
  methods = [registry.build_method(spec, settings, load, args.model) for spec in specs]
  results = evaluate(records, baseline, methods, out, identity=identity, judge=judge, judge_note=judge_note,
                     progress=args.progress)
  results["settings"].update(baseline=baseline.name, methods=[m.name for m in methods], limit=args.limit)
  paths = write_outputs(results, out)
  print("\n".join(speed_table(results)))
  judged = f"quality judged by {results['judge']['name']}" if judge is not None else "quality not judged"
  print(f"{judged}. {judge_note}".strip())
  print("wrote " + ", ".join(str(p) for p in paths))
  return 0


def check_numbers(args) -> None:
  from pasta_jax.errors import PastaError

  if args.limit is not None and args.limit < 1:
    raise PastaError(f"--limit must be at least 1, got {args.limit}")
  if args.max_new_tokens < 1:
    raise PastaError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
  if args.lanes < 1:
    raise PastaError(f"--lanes must be at least 1, got {args.lanes}")
  if not args.repetition_penalty > 0:
    raise PastaError(f"--repetition-penalty must be positive, got {args.repetition_penalty}")

