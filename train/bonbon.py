"""BoNBoN rounds: sample -> score -> BoNBoN, r times, each round starting from the last model.

  python -m train.bonbon --model runs/sft/model --baseline runs/baseline_sft/model --data lima \
      --out runs/bonbon --rounds 2 [--judge http | --judge local:MODEL | --quality-measure rouge|logp
      | --quality-weight 0]
      [--samples 10 --temperature 1.0] [--alpha 0.005 --beta 0.1 --lr 5e-7] [--config tpu_configs/...]

Per round k (files in <out>/round_<k>/): the policy samples N answers per prompt with the batched
interpreter, the Baseline-SFT model answers greedily, the judge compares every sample with the
baseline and the reference answer in both orders (or, with --quality-measure rouge, ROUGE-L against the
reference answer over the baseline's stands in for the judge), and the best and worst samples by
speedup + lambda * quality become a pair. The reference log-probs (--reference: the Pasta-SFT model in every
round, as the paper; or each round's start model) are
computed once and stored with the pairs, then BoNBoN trains. Every stage resumes: run the same
command again after an interruption. `--pairs-only` stops after writing round 1's pairs.
"""

from __future__ import annotations

import argparse
import math

import jax

from pasta_jax.data.sources import DataError
from pasta_jax.data.tfds_builders import data_source
from pasta_jax.errors import PastaError
from pasta_jax.model.load import load_model
from pasta_jax.paths import run_path
from pasta_jax.preference.build import build_pairs
from pasta_jax.preference.config import QUALITY_MEASURES, SPEED_MEASURES, PreferenceConfig
from pasta_jax.preference.rounds import BONBON_LEARNING_RATE, run_rounds
from pasta_jax.training.distributed import maybe_initialize_distributed
from train.common import add_config_flags, model_path, run_main, train_config


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="train.bonbon", description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", required=True, help="prompts: lima, alpaca_gpt4_1k, alpaca_5k or a JSONL path")
  parser.add_argument("--data-dir", default=None, help="TFDS data dir (default: ~/tensorflow_datasets)")
  parser.add_argument("--limit", type=int, help="use the first N prompts")
  parser.add_argument("--baseline", help="the Baseline-SFT model (default: --model, i.e. the policy itself)")
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--reference", choices=["sft", "round_start"], default="sft",
                      help="reference log-probs: the starting (Pasta-SFT) model in every round, as the paper, "
                           "or each round's start model")
  parser.add_argument("--pairs-only", action="store_true", help="write round 1's preference pairs, do not train")
  parser.add_argument("--judge", default="auto", help="auto (http if PASTA_JUDGE_BASE_URL is set), http, "
                      "local[:MODEL] or none (needs --quality-weight 0)")
  parser.add_argument("--samples", type=int, default=PreferenceConfig.num_samples, help="N answers per prompt")
  parser.add_argument("--temperature", type=float, default=PreferenceConfig.temperature)
  parser.add_argument("--duplicate-penalty", type=float, default=PreferenceConfig.duplicate_penalty,
                      help="score -= this x share of sibling-block pairs that repeat each other")
  parser.add_argument("--speed-measure", choices=SPEED_MEASURES, default=PreferenceConfig.speed_measure,
                      help="speedup: baseline tokens / sample critical path (the paper's; rewards shorter answers "
                           "too); parallelism: the sample's own tokens / its critical path (length-neutral)")
  parser.add_argument("--quality-weight", type=float, default=PreferenceConfig.quality_weight,
                      help="lambda in score = speedup + lambda * quality; inf ranks by quality alone")
  parser.add_argument("--quality-measure", choices=QUALITY_MEASURES, default=PreferenceConfig.quality_measure,
                      help="quality in the score: the pairwise judge's wins/losses; rouge: ROUGE-L against each "
                           "record's reference answer over the baseline answer's; logp: the sample's per-token "
                           "likelihood under the baseline over the baseline answer's (neither needs a judge)")
  parser.add_argument("--max-new-tokens", type=int, default=PreferenceConfig.max_new_tokens)
  parser.add_argument("--lanes", type=int, default=PreferenceConfig.lanes)
  parser.add_argument("--requests-per-run", type=int, default=PreferenceConfig.requests_per_run,
                      help="interpreter batch size (prompts x samples decoded together)")
  add_config_flags(parser)
  return parser.parse_args(argv)


def preference_config(args) -> PreferenceConfig:
  return PreferenceConfig(num_samples=args.samples, temperature=args.temperature, quality_weight=args.quality_weight,
                          max_new_tokens=args.max_new_tokens, lanes=args.lanes,
                          requests_per_run=args.requests_per_run, seed=args.seed or 0,
                          duplicate_penalty=args.duplicate_penalty, speed_measure=args.speed_measure,
                          quality_measure=args.quality_measure)


def prompt_records(args) -> list[dict]:
  split = f"train[:{args.limit}]" if args.limit else "train"
  records = list(data_source(args.data, args.data_dir, split))
  if not records:
    raise DataError(f"--data {args.data}: no prompts in split {split}")
  return records


def judge_factory(spec: str, quality_weight: float, quality_measure: str = "judge"):
  """folder -> the (cached) judge of that folder, or None when speed (or ROUGE-L) alone decides."""
  from pasta_jax.eval.methods import cached_model
  from pasta_jax.judges.factory import make_judge

  def judge_for(folder):
    if quality_weight == 0 or quality_measure != "judge":
      return None
    judge, note = make_judge(spec, run_path(folder), cached_model)
    if judge is None:
      raise PastaError(f"quality_weight={quality_weight} needs a judge: {note}")
    if note:
      print(f"judge: {note}")
    return judge

  return judge_for


def main(argv=None) -> int:
  args = parse_args(argv)
  maybe_initialize_distributed(force=args.multi_host)
  if args.rounds < 1:
    raise PastaError(f"--rounds must be at least 1, got {args.rounds}")
  lr = {} if args.lr is not None or args.config else {"learning_rate": BONBON_LEARNING_RATE}
  config = train_config(args, jax.device_count(), objective="bonbon", **lr)
  pref = preference_config(args)
  start = model_path(args)
  baseline_path = args.baseline or start
  baseline = load_model(baseline_path)
  records = prompt_records(args)
  judge_for = judge_factory(args.judge, pref.quality_weight, pref.quality_measure)
  out = run_path(args.out)
  if args.pairs_only:
    folder = out / "round_1" / "pairs"
    summary = build_pairs(load_model(start), baseline, records, judge_for(folder), pref, folder,
                          identity={"start_model": str(start), "round": 1})
    print(f"pairs: {summary.line()}\nwritten to {folder}")
    return 0
  print(f"BoNBoN: {args.rounds} round(s), alpha={config.bonbon_alpha}, beta={config.bonbon_beta}, "
        f"lr={config.learning_rate:g}, lambda={'inf' if math.isinf(pref.quality_weight) else pref.quality_weight}")
  results = run_rounds(args.rounds, start, baseline, records, judge_for, pref, config, out, stop_after=args.stop_after,
                       reference=args.reference)
  for r in results:
    losses = f"loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else "already done"
    print(f"round {r.index}: from {r.start_model} -> {r.model_dir or 'stopped early'} ({losses})")
  return 0


if __name__ == "__main__":
  run_main(main)
