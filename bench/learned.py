"""The shipped PASTA model in free decoding against the shipped Baseline-SFT (CPU or any device).

Both models decode freely (nothing forced), greedy, batch 1, through the same interpreter, each prompt
twice with the second run timed (`pasta eval`'s runner: resumable, a report and a Pareto plot in
--out). Realized speedup per prompt = Baseline-SFT seconds / PASTA seconds (different answers, as the
paper measures it); theoretical = Baseline-SFT content tokens / the PASTA answer's critical path.
Then what the model wrote: fork rate, well-formed tags, truncation, duplicate blocks, and quality
proxies (ROUGE-L against the reference answer, log p per token under Baseline-SFT, or under --scorer:
Baseline-SFT's own greedy answers are its mode, so a third model, the base one, gives a second reading;
`--judge local` adds the local pairwise judge, which is weak: see the report's note), plotted against the
realized speedup in quality_pareto.png.

Both models decode under the shipped sampling defaults: what --repetition-penalty and --distinct-topics leave
unset comes from the (first) PASTA model's generation.json, said in the output, so the default run measures the
shipped default as `pasta generate` runs it.

--fork-bias takes a list (`0,-8,4,8,12,16`): each value is one PASTA row (`SamplingConfig.fork_bias`, the logit offset
on the promise-open token) against the one baseline run, decoded once, so one run gives the knob's curve (fork rate,
theoretical and realized speedup, every quality proxy per setting: learned.md's "Fork-bias curve"). A row of bias
b != 0 is named `pasta:MODEL@fork_bias=b`, so a resumed folder decodes a new setting afresh; the RESULT line is the
first model at the first setting listed. --max-topic-tokens N caps every PASTA row's promise topics at N tokens
(`SamplingConfig.max_topic_tokens`; its rows are named `...@max_topic_tokens=N`, and each row's cuts are counted).

  python -m bench.learned [--limit 100] [--prompts alpaca_eval_805|mt_bench_questions|FILE]
                          [--model pasta] [--baseline baseline-sft] [--scorer base] [--out runs/learned]
                          [--fork-bias 0,-8,4,8,12,16] [--max-topic-tokens 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from pathlib import Path

import jax.numpy as jnp
from tqdm import tqdm

from pasta_jax.data import sources
from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.eval import methods as M
from pasta_jax.eval.learned import figure_lines, learned_figures, result_line
from pasta_jax.eval.learned_plot import plot_quality_pareto
from pasta_jax.eval.quality import answer_logprob
from pasta_jax.eval.report import speed_table, write_outputs
from pasta_jax.eval.runner import evaluate
from pasta_jax.judges.factory import make_judge
from pasta_jax.lang import schema
from pasta_jax.methods import Pasta
from pasta_jax.model.load import GENERATION_FILE, generation_defaults


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.learned", description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", default="alpaca_eval_805", help="shared dataset name or JSONL (instruction/turns)")
  parser.add_argument("--limit", type=int, default=100)
  parser.add_argument("--model", nargs="+", default=[None], metavar="MODEL",
                      help="the PASTA model(s) (default: the shipped tuned default); several give one row each, "
                           "and the RESULT line is the first one's")
  parser.add_argument("--baseline", default="baseline-sft", help="the Baseline-SFT model (default: the shipped one)")
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--repetition-penalty", type=float, default=None,
                      help="greedy under CTRL's repetition penalty, for both models alike (1 = off; default: the "
                           "PASTA model's generation.json, else off)")
  parser.add_argument("--distinct-topics", action=argparse.BooleanOptionalAction, default=None,
                      help="PASTA's main may not reuse a promise topic (decode.sampling.SamplingConfig; default: the "
                           "PASTA model's generation.json, else off)")
  parser.add_argument("--fork-bias", type=fork_biases, default=(0.0,), metavar="X[,X...]",
                      help="PASTA's promise-open logit offset; a list gives one PASTA row per value against the one "
                           "baseline run (default: 0, off)")
  parser.add_argument("--max-topic-tokens", type=topic_cap, default=0, metavar="N",
                      help="PASTA rows: a promise topic has at most N tokens, then main must close it (0: no cap)")
  parser.add_argument("--head-dtype", default=None, metavar="bfloat16",
                      help="both models' output head in this narrower dtype (api.check_head_dtype; default: float32)")
  parser.add_argument("--certify-head", action="store_true",
                      help="both models' greedy choices certified against the float32 head at the bfloat16 head's "
                           "cost (decode/certified_head.py): the float32 tokens, faster")
  parser.add_argument("--judge", default="none", metavar="none|local[:MODEL]|http")
  parser.add_argument("--scorer", default=None, metavar="MODEL",
                      help="the model whose log p per token scores every answer (default: the baseline)")
  parser.add_argument("--no-logprob", dest="logprob", action="store_false",
                      help="skip the log-likelihood proxy (one scorer forward per answer)")
  parser.add_argument("--out", default="runs/learned", help="run folder (resumed if it holds the same run)")
  return parser.parse_args(argv)


def fork_biases(text: str) -> tuple[float, ...]:
  """`--fork-bias` text: comma-separated finite numbers, each once (`-2,0,2`)."""
  try:
    values = tuple(float(x) + 0.0 for x in text.split(","))  # + 0.0: -0 is 0
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as -2,0,2, got {text!r}") from None
  if not all(math.isfinite(v) for v in values) or len(set(values)) != len(values):
    raise argparse.ArgumentTypeError(f"expected distinct finite numbers, got {text!r}")
  return values


def topic_cap(text: str) -> int:
  """`--max-topic-tokens` text: a whole number >= 0 (0: no cap)."""
  try:
    SamplingConfig(max_topic_tokens=int(text))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
  return int(text)


def method_name(path: str | None, fork_bias: float, max_topic_tokens: int = 0) -> str:
  """A PASTA row's name in the run folder: a fork bias other than 0 and a topic cap are part of it, so each setting
  is its own row."""
  return (f"pasta:{path or 'default'}" + (f"@fork_bias={fork_bias:g}" if fork_bias else "")
          + (f"@max_topic_tokens={max_topic_tokens}" if max_topic_tokens else ""))


def shipped_sampling(args, model) -> tuple[float, bool, str]:
  """(repetition penalty, distinct topics, a line saying where each came from): the flags, and what they leave
  unset from `model`'s generation.json (the shipped default's sampling, as `pasta generate` takes it)."""
  defaults = generation_defaults(model)
  where = f"{model.source}/{GENERATION_FILE}"

  def pick(flag, key: str, off):
    if flag is not None:
      return flag, "flag"
    return (defaults[key], where) if key in defaults else (off, "off: not in " + where)

  (penalty, penalty_from), (topics, topics_from) = (pick(args.repetition_penalty, "repetition_penalty", 1.0),
                                                    pick(args.distinct_topics, "distinct_topics", False))
  line = (f"sampling, both models: repetition penalty {penalty:g} ({penalty_from}), distinct topics "
          f"{'on' if topics else 'off'} ({topics_from})")
  return float(penalty), bool(topics), line


def main(argv=None) -> int:
  args = parse_args(argv)
  records = sources.read_records(args.prompts, args.limit)
  baseline_model = M.cached_model(args.baseline)
  models = [M.cached_model(path) for path in args.model]
  penalty, topics, sampling_line = shipped_sampling(args, models[0])
  print(sampling_line)
  settings = M.DecodeSettings(max_new_tokens=args.max_new_tokens, lanes=args.lanes, chat=True,
                              repetition_penalty=penalty, distinct_topics=topics,
                              head_dtype=args.head_dtype, certify_head=args.certify_head)
  # Both decode with PASTA's interpreter rules (Baseline-SFT writes no tags, so its answers are sequential ones).
  pasta = Pasta(lanes=args.lanes)
  cap = args.max_topic_tokens
  methods = [M.InterpreterMethod(method_name(path, bias, cap), m,
                                 dataclasses.replace(settings, fork_bias=bias, max_topic_tokens=cap), pasta)
             for path, m in zip(args.model, models) for bias in args.fork_bias]
  baseline = M.InterpreterMethod(f"sequential:{args.baseline}", baseline_model, settings, pasta)
  for method in methods:
    print(f"{method.name}: {method.model.describe()}")
  print(f"{baseline.name}: {baseline_model.describe()}")
  out = Path(args.out)
  judge, note = make_judge(args.judge, out, M.cached_model)
  identity = dict(prompts=sources.dataset_name(args.prompts), models=[m.source for m in models],
                  baseline=baseline_model.source, **settings.identity())
  results = evaluate(records, baseline, methods, out, identity=identity, judge=judge, judge_note=note)
  results["settings"].update(baseline=baseline.name, methods=[m.name for m in methods], limit=args.limit)
  paths = write_outputs(results, out)
  scorer = None
  scorer_name = args.scorer or args.baseline
  if args.logprob:
    scoring = M.cached_model(args.scorer) if args.scorer else baseline_model
    bar = tqdm(total=(2 + len(methods)) * len(records), desc=f"log p under {scorer_name}")
    # cached: the baseline's answers and the references are scored once, however many PASTA models are compared
    scorer = functools.lru_cache(maxsize=None)(
        lambda prompt, text: (bar.update(1), answer_logprob(scoring, prompt, text)[0])[1])
  # each model's tags parse in the position mode it decoded in (Pred-1x promises exact lengths)
  figures = {m.name: {**learned_figures(results, records, m.name, baseline.name, scorer,
                                        length_step=schema.length_step(pasta.mode_for(m.model))),
                      "scorer": scorer_name} for m in methods}
  for method in methods:
    figures[method.name].update(fork_bias=method.settings.fork_bias, max_topic_tokens=method.settings.max_topic_tokens)
  (out / "learned.json").write_text(json.dumps(figures, indent=1))
  pareto = plot_quality_pareto(figures, out / "quality_pareto.png")
  lines = [sampling_line, ""]
  if len(args.fork_bias) > 1:
    lines += curve_lines(figures)
  lines += [line for name, f in figures.items() for line in [f"## {name}", "", *figure_lines(f), ""]]
  lines += [api.head_plan_line(baseline_model.config, jnp.float32, args.head_dtype, args.certify_head), ""]
  if args.certify_head:  # how often the certificate failed and a step chose again from the float32 head
    lines += [f"- `{m['name']}`: the certified head fell back to float32 at {m['totals']['head_fallbacks']} of "
              f"{m['totals']['steps']} steps" for m in results["methods"]] + [""]
  (out / "learned.md").write_text("\n".join(["# bench.learned", "", *lines]))
  print("\n".join(speed_table(results)))
  print("\n".join(lines))
  print("wrote " + ", ".join(str(p) for p in [*paths, out / "learned.md", pareto]))
  print(result_line(figures[methods[0].name]))
  return 0


CURVE = (("fork rate", "fork_rate", 3), ("well-formed", "well_formed", 3), ("truncated", "truncated", 3),
         ("topics cut", "refusals", 0),
         ("duplicate blocks", "duplicate_rate", 3), ("repeated items", "repeated_items", 3),
         ("misnumbered", "misnumbered", 3), ("ROUGE-L", "rouge_l", 4), ("log p", "logprob", 4))


def curve_lines(figures: dict) -> list[str]:
  """The fork-bias curve: one row per PASTA row (model, bias), its speedups and every quality proxy."""
  shown = [(label, key, digits) for label, key, digits in CURVE
           if any(key in f["pasta"] for f in figures.values())]
  lines = ["## Fork-bias curve", "",
           "| PASTA row | fork_bias | realized (geo) | theoretical (geo) | " + " | ".join(c[0] for c in shown) + " |",
           "|---|---|---|---|" + "---|" * len(shown)]
  for name, f in figures.items():
    cells = [f"{f['pasta'][key]:.{digits}f}" if key in f["pasta"] else "-" for _, key, digits in shown]
    lines.append(f"| {name} | {f['fork_bias']:g} | {f['realized']:.3f} | {f['theoretical']:.3f} | "
                 + " | ".join(cells) + " |")
  return [*lines, ""]


if __name__ == "__main__":
  raise SystemExit(main())
