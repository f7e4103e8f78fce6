"""The whole PASTA recipe on one model, as one resumable command.

  python -m train.recipe --out runs/pasta270m [--model M] [--seq-len 192] [--epochs 2] [--lora-rank 16]
                         [--stages records,baseline_sft,pasta_sft,bonbon] [--lambdas 0,1]

Stages (each one is skipped when its output is complete, and a stage cut off mid-way resumes from its last
Orbax checkpoint when the same command runs again, also after a restart or a kill at any moment: every file
is written whole under a temporary name and renamed, a model folder is complete once its marker, written
last, exists; `pasta_jax.model.runfiles`):
  records        annotate the training pools structurally (`lima`, `alpaca_gpt4_1k`, `alpaca_5k`), keep
                 the answers with lists whose PASTA layout fits --seq-len, optionally keep only what the
                 model-verified filter accepts (--verify), then fork only the items that save main at
                 least --min-saving tokens (others stay in main; an answer with none trains plain), or with
                 --group-blocks N each list as at most N blocks of consecutive items; hold out a split
                 -> records/{heldout.jsonl,report.json,train.jsonl} (train.jsonl last: the stage's marker)
  baseline_sft   Baseline-SFT (tags stripped) on exactly those records -> baseline_sft/model
  pasta_sft      Pasta-SFT on the same records -> pasta_sft/model
  bonbon         per lambda: N samples per prompt from the interpreter at T = 1, scored by speedup +
                 lambda x quality, best/worst pairs, BoNBoN with Pasta-SFT as the reference
                 -> bonbon_l{lambda}/round_{R}/train/model (--bonbon-rounds R, each round from the last). Round
                 1's samples do not depend on lambda: every lambda after the first starts from the first one's
                 samples (it samples only what is missing)
  ship           copies the adapters into the package (pasta_jax/adapters/: baseline-sft, pasta-sft, and
                 pasta-bon from --ship-lambda), where `load_model()` and `pasta generate` find them
Both SFT stages train adapters (LoRA + tag/chat embedding rows) over the frozen base by default.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tqdm import tqdm

from pasta_jax.data.sources import shared_data_dir
from pasta_jax.errors import PastaError
from pasta_jax.model import runfiles
from pasta_jax.preference.config import QUALITY_MEASURES, SPEED_MEASURES, PreferenceConfig
from train.common import run_main

POOLS = ("lima", "alpaca_gpt4_1k", "alpaca_5k")
STAGES = ("records", "baseline_sft", "pasta_sft", "bonbon", "ship")
SHIP = {"baseline-sft": "baseline_sft/model", "pasta-sft": "pasta_sft/model"}  # shipped name -> run folder


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="train.recipe", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="run folder; running the same command again resumes")
  parser.add_argument("--model", help="base model (default: the embedded Gemma 3 270M base)")
  parser.add_argument("--stages", default=",".join(STAGES[:-1]),
                      help=f"comma list of {', '.join(STAGES)} (default: all but ship)")
  parser.add_argument("--pools", default=",".join(POOLS), help="training pools (shared data names or JSONL paths)")
  parser.add_argument("--seq-len", type=int, default=192)
  parser.add_argument("--num-threads", type=int, default=16)
  parser.add_argument("--held-out", type=float, default=0.03, help="share of kept records held out")
  parser.add_argument("--min-saving", type=int, default=6,
                      help="a block (a group of items, or one item) forks only if that saves main at least this "
                           "many tokens (its text minus its promise); answers where nothing does train plain")
  parser.add_argument("--group-blocks", type=int, default=3,
                      help="> 0: each list forks as at most this many blocks of consecutive items, its last group "
                           "staying in main, and --min-saving applies to each block (structural_grouped); "
                           "0: one block per item")
  parser.add_argument("--min-block-tokens", type=int, default=12,
                      help="with --group-blocks: a list forks into at most its tokens // this many groups")
  parser.add_argument("--verify", action="store_true", help="keep only records the model-verified filter accepts")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--grad-accum", type=int, default=1,
                      help="SFT stages: micro-batches per step (the same step in less memory; a run resumes under "
                           "another value)")
  parser.add_argument("--length-bucket", type=int, default=0,
                      help="SFT stages: > 0 batches examples of like length, each batch padded to a multiple of "
                           "this (about half the tokens a step on the recipe's records); 0: padded to --seq-len")
  parser.add_argument("--lr", type=float, default=3e-4)
  parser.add_argument("--warmup-steps", type=int, default=10)
  parser.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning")
  parser.add_argument("--lora-alpha", type=float, default=16.0)
  parser.add_argument("--lora-targets", default="q,k,v,o,gate,up,down")
  parser.add_argument("--kl-weight", type=float, default=0.0, help="SFT stages: KL(tuned || base) per answer token")
  parser.add_argument("--pasta-kl-to-baseline", type=float, default=0.0, metavar="WEIGHT",
                      help="pasta_sft: instead, KL(tuned || this run's Baseline-SFT) on the answer's text (tags left "
                           "out) at this weight, pulling Pasta-SFT's text toward Baseline-SFT's")
  parser.add_argument("--lambdas", default="0,1", help="BoNBoN quality weights, one run each (Pareto)")
  parser.add_argument("--bonbon-prompts", type=int, default=32, help="held-in prompts sampled for BoNBoN")
  parser.add_argument("--samples", type=int, default=4, help="BoNBoN: N answers per prompt")
  parser.add_argument("--judge", default="local:base", help="BoNBoN quality judge (http or local:MODEL)")
  parser.add_argument("--bonbon-rounds", type=int, default=1,
                      help="BoNBoN rounds, each starting from the last round's model, Pasta-SFT the reference in "
                           "every one (as the paper); a finished round is kept, so raising it adds rounds")
  parser.add_argument("--bonbon-lr", type=float, default=2e-5,
                      help="BoNBoN learning rate (the paper's 5e-7 is for full fine-tuning; adapters need more)")
  parser.add_argument("--duplicate-penalty", type=float, default=PreferenceConfig.duplicate_penalty,
                      help="BoNBoN: score penalty per share of sibling blocks that repeat each other")
  parser.add_argument("--bonbon-tokens", type=int, default=192, help="BoNBoN: max new tokens per sample")
  parser.add_argument("--speed-measure", choices=list(SPEED_MEASURES), default="speedup",
                      help="BoNBoN's speed score: the paper's speedup over Baseline-SFT (rewards shorter answers too), "
                           "or the sample's own parallelism")
  parser.add_argument("--quality-measure", choices=list(QUALITY_MEASURES), default=PreferenceConfig.quality_measure,
                      help="BoNBoN's quality score: the --judge's wins/losses, ROUGE-L against the record's "
                           "reference answer over Baseline-SFT's (rouge), or the per-token likelihood under "
                           "Baseline-SFT over its own answer's (logp); the last two need no judge")
  parser.add_argument("--ship-lambda", type=float, default=None,
                      help="ship stage: the BoNBoN lambda whose model ships as pasta-bon (default: none ships)")
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


def _write_jsonl(path: Path, records) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  runfiles.write_rows(path, records)  # a file appears whole or not at all


def _read_pool(name: str) -> list[dict]:
  path = Path(name) if name.endswith(".jsonl") else shared_data_dir() / f"{name}.jsonl"
  if not path.is_file():
    raise PastaError(f"training pool {name!r}: no file {path}")
  records = [value for _, value in runfiles.iter_jsonl(path, PastaError)]
  # ids repeat across pools: prefix the pool so one training file keeps them unique
  return [{**r, "id": f"{path.stem}-{r.get('id', i)}", "pool": path.stem} for i, r in enumerate(records)]


def stage_records(args, folder: Path) -> None:
  """Annotate, keep what fits (and what the filter accepts), hold out a split."""
  from pasta_jax.data.encode import EncodeConfig, encode_example
  from pasta_jax.data.pipeline import annotate_records
  from pasta_jax.data.structural_grouped import Grouping
  from pasta_jax.model.load import load_model
  model = load_model(args.model or "base")
  vocab = model.tokenizer.tag_vocab()
  encode = EncodeConfig(seq_len=args.seq_len, num_threads=args.num_threads)
  counts: dict[str, int] = {}
  kept = []
  for pool in args.pools.split(","):
    records = annotate_records(_read_pool(pool), model.tokenizer, progress=True)
    for record in tqdm(records, desc=f"fit {pool}", leave=False):
      if not record.get("annotated"):
        counts["no block"] = counts.get("no block", 0) + 1
        continue
      try:  # the PASTA layout is the longer one: what fits it fits Baseline-SFT's tag-free layout too
        encode_example(record, model.tokenizer, vocab, encode)
      except PastaError as err:
        reason = type(err).__name__
        counts[reason] = counts.get(reason, 0) + 1
        continue
      kept.append(record)
  if args.verify:
    kept = _verified(kept, model, counts)
  # Which answers are kept does not depend on --min-saving or the grouping (Baseline-SFT's records stay the
  # same); they decide only which of their items fork.
  grouping = None
  if args.group_blocks:
    grouping = Grouping(args.group_blocks, args.min_block_tokens, min_saving=args.min_saving)
  kept = annotate_records(kept, model.tokenizer, min_saving=args.min_saving, grouping=grouping)
  counts["kept as plain answers (nothing earns a fork)"] = sum(not r.get("annotated") for r in kept)
  random.Random(args.seed).shuffle(kept)
  held = max(1, int(len(kept) * args.held_out))
  report = {"kept": len(kept), "train": len(kept) - held, "held_out": held, "dropped": counts,
            "by_pool": {p: sum(r["pool"] == p for r in kept) for p in sorted({r["pool"] for r in kept})}}
  _write_jsonl(folder / "heldout.jsonl", kept[:held])
  runfiles.write_atomic(folder / "report.json", json.dumps(report, indent=1))
  _write_jsonl(folder / "train.jsonl", kept[held:])  # last: its existence says the stage is done (`_done`)
  print(f"records: {report}")


def _verified(records: list[dict], model, counts: dict) -> list[dict]:
  from pasta_jax.data.verify import verify
  kept = [r for r in tqdm(records, desc="model-verified filter") if verify(r, model).keep]
  counts["rejected by the model-verified filter"] = len(records) - len(kept)
  return kept


def stage_sft(args, out: Path, stage: str) -> None:
  from train import sft
  objective = {"pasta_sft": "sft", "baseline_sft": "baseline_sft"}[stage]
  flags = ["--data", str(out / "records" / "train.jsonl"), "--objective", objective, "--annotate", "none",
           "--out", str(out / stage), "--seq-len", str(args.seq_len), "--num-threads", str(args.num_threads),
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
           "--grad-accum", str(args.grad_accum), "--lr", str(args.lr),
           "--warmup-steps", str(args.warmup_steps), "--lora-rank", str(args.lora_rank),
           "--lora-alpha", str(args.lora_alpha), "--lora-targets", args.lora_targets,
           "--seed", str(args.seed), "--save-every", "10", "--length-bucket", str(args.length_bucket),
           *_kl_flags(args, out, stage)]
  if args.model:
    flags += ["--model", args.model]
  code = sft.main(flags)
  if code:
    raise PastaError(f"{stage} stopped with exit code {code}")


def _kl_flags(args, out: Path, stage: str) -> list[str]:
  if stage == "pasta_sft" and args.pasta_kl_to_baseline > 0:
    reference = out / "baseline_sft" / "model"
    if not _done(out, "baseline_sft"):
      raise PastaError(f"--pasta-kl-to-baseline needs this run's Baseline-SFT first: {reference} is not complete")
    return ["--kl-weight", str(args.pasta_kl_to_baseline), "--kl-reference", str(reference)]
  return ["--kl-weight", str(args.kl_weight)]


def stage_bonbon(args, out: Path) -> None:
  from train import bonbon
  prompts = out / "records" / "bonbon_prompts.jsonl"
  if not prompts.exists():
    train = [json.loads(line) for line in (out / "records" / "train.jsonl").read_text().splitlines()]
    _write_jsonl(prompts, train[: args.bonbon_prompts])
  lambdas = [float(x) for x in args.lambdas.split(",")]
  for lam in lambdas:
    _share_samples(out / f"bonbon_l{lambdas[0]:g}", out / f"bonbon_l{lam:g}")
    flags = ["--model", str(out / "pasta_sft" / "model"), "--baseline", str(out / "baseline_sft" / "model"),
             "--data", str(prompts), "--out", str(out / f"bonbon_l{lam:g}"), "--rounds", str(args.bonbon_rounds),
             "--samples", str(args.samples), "--quality-weight", str(lam), "--judge", args.judge,
             "--duplicate-penalty", str(args.duplicate_penalty), "--speed-measure", args.speed_measure,
             "--quality-measure", args.quality_measure,
             "--max-new-tokens", str(args.bonbon_tokens), "--seq-len", str(args.bonbon_tokens + 128),
             "--num-threads", str(args.num_threads), "--lr", str(args.bonbon_lr),
             "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha),
             "--lora-targets", args.lora_targets, "--batch-size", "8", "--grad-accum", "4", "--epochs", "2",
             "--save-every", "4"]  # micro-batches of 2 pairs: 8 x 2 x 320 tokens of logits do not fit 24 GiB
    code = bonbon.main(flags)
    if code:
      raise PastaError(f"BoNBoN (lambda {lam:g}) stopped with exit code {code}")


def _share_samples(first: Path, run: Path) -> None:
  """Copies the first lambda's samples into another lambda's round 1 before it samples: the samples
  depend on the policy, the prompts and the seed, not on lambda, and sampling is the stage's cost."""
  from pasta_jax.preference.build import SAMPLES
  source, target = (d / "round_1" / "pairs" / SAMPLES for d in (first, run))
  if source.is_file() and not target.exists() and first != run:
    target.parent.mkdir(parents=True, exist_ok=True)
    runfiles.write_atomic(target, source.read_bytes())
    print(f"{run.name}: starting from {first.name}'s samples")


def stage_ship(args, out: Path) -> None:
  import shutil

  from pasta_jax.model import lora
  from pasta_jax.model.load import SHIPPED_DIR
  chosen = dict(SHIP)
  if args.ship_lambda is not None:
    chosen["pasta-bon"] = f"bonbon_l{args.ship_lambda:g}/round_{args.bonbon_rounds}/train/model"
  for name, rel in chosen.items():
    source = out / rel
    if not lora.is_adapter_folder(source):
      raise PastaError(f"ship: {source} holds no adapter (run its stage first)")
    target = SHIPPED_DIR / name
    if source.resolve() == target.resolve():
      print(f"{name}: {source} is the shipped adapter itself")
      continue
    target.mkdir(parents=True, exist_ok=True)  # the adapter's files are replaced; its medusa/ heads stay
    for file in (lora.WEIGHTS_FILE, lora.CONFIG_FILE):  # each whole; the config (what loading reads first) last
      runfiles.save_atomic(target / file, lambda tmp, src=source / file: shutil.copy2(src, tmp))
    if name != "baseline-sft":
      _recommend_pasta(target, source)
    print(f"shipped {source} as {name} ({(target / lora.WEIGHTS_FILE).stat().st_size / 2**20:.1f} MiB)")


def _recommend_pasta(folder: Path, source: Path) -> None:
  """A PASTA adapter's generation.json names method pasta (its promised blocks only the interpreter writes), so
  `pasta generate` decodes it with the interpreter by default, and the position mode it was trained in (from the
  trained model's own generation.json) where that is not pred; the file's other settings stay."""
  from pasta_jax.model.load import GENERATION_FILE
  path, trained = folder / GENERATION_FILE, source / GENERATION_FILE
  values = json.loads(path.read_text()) if path.is_file() else {}
  mode = json.loads(trained.read_text()).get("position_mode", "pred") if trained.is_file() else "pred"
  values = {k: v for k, v in values.items() if k != "position_mode"}
  values.update({"method": "pasta"}, **({"position_mode": mode} if mode != "pred" else {}))
  runfiles.write_atomic(path, json.dumps(values, indent=1) + "\n")


def _done(out: Path, stage: str) -> bool:
  if stage == "records":
    return (out / "records" / "train.jsonl").is_file()
  if stage in ("baseline_sft", "pasta_sft"):
    return runfiles.is_complete(out / stage / "model")  # the trainer's export, published with its marker
  return False  # bonbon: its own command skips finished rounds; ship: always copies


def main(argv=None) -> int:
  args = parse_args(argv)
  out = Path(args.out)
  stages = [s.strip() for s in args.stages.split(",") if s.strip()]
  unknown = sorted(set(stages) - set(STAGES))
  if unknown:
    raise PastaError(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
  for stage in tqdm(stages, desc="recipe", file=sys.stdout):
    if _done(out, stage):
      print(f"[{stage}] done before: skipped")
      continue
    print(f"[{stage}] running")
    if stage == "records":
      stage_records(args, out / "records")
    elif stage == "bonbon":
      stage_bonbon(args, out)
    elif stage == "ship":
      stage_ship(args, out)
    else:
      stage_sft(args, out, stage)
  return 0


if __name__ == "__main__":
  run_main(main)
