"""Masked SFT (PASTA layout) or Baseline-SFT (tags stripped) on instruction data.

  python -m train.sft --data lima --out runs/sft [--config tpu_configs/gemma7b_sft_v5p-8.json]
                      [--objective baseline_sft] [--annotate structural] [--limit 300] [--sample 3]

Data: a shared dataset name or any JSONL of the same shape, read through its TFDS builder
(array_record) and batched by grain by step. Records without an `annotated` field are annotated
structurally (`--annotate none` trains them as plain answers). After training: the loss curve
(`<out>/loss.png`) and, with --sample N, the exported model decodes N held-out prompts with the
PASTA interpreter (`<out>/samples.md`), reporting how many emitted well-formed tags.
"""

from __future__ import annotations

import argparse
import math

import jax

from pasta_jax.data.encode import EncodeConfig
from pasta_jax.data.pipeline import annotate_records, layout_dataset
from pasta_jax.data.sources import DataError
from pasta_jax.data.tfds_builders import data_source
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.model.load import load_model
from pasta_jax.paths import is_remote, run_path
from pasta_jax.training.config import SFT_OBJECTIVES
from pasta_jax.training.distributed import batch_slice, is_main_process, maybe_initialize_distributed
from pasta_jax.training.plots import plot_loss_curve
from pasta_jax.training.trainer import Trainer
from train.common import add_config_flags, model_path, run_main, train_config


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="train.sft", description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", required=True, help="lima, alpaca_gpt4_1k, alpaca_5k or a JSONL path")
  parser.add_argument("--data-dir", default=None, help="TFDS data dir (default: ~/tensorflow_datasets)")
  parser.add_argument("--objective", choices=SFT_OBJECTIVES, default="sft",
                      help="sft (PASTA), baseline_sft (tags stripped), apar_sft (APAR-format data, APAR's mask) or "
                           "scoped_sft (the earlier paper's scoped form: its structural rule, synchronous prefixes)")
  parser.add_argument("--annotate", choices=["structural", "none"], default="structural")
  parser.add_argument("--limit", type=int, help="use the first N training records")
  parser.add_argument("--only-annotated", action="store_true",
                      help="train only on records the annotator gave blocks (short runs that must learn the tags)")
  parser.add_argument("--sample", type=int, default=0, help="decode N held-out prompts after training")
  parser.add_argument("--sample-tokens", type=int, default=160)
  add_config_flags(parser)
  return parser.parse_args(argv)


def training_records(args, tokenizer) -> tuple[list[dict], list[dict]]:
  """(train records, held-out records), annotated unless --annotate none."""
  split = f"train[:{args.limit}]" if args.limit else "train"
  train = list(data_source(args.data, args.data_dir, split))
  try:
    held_out = list(data_source(args.data, args.data_dir, "validation"))
  except DataError:  # sources without a validation split: hold out nothing
    held_out = []
  if args.annotate == "structural" and args.objective in ("sft", "baseline_sft", "scoped_sft"):  # same records
    scoped = args.objective == "scoped_sft"
    field, annotator = ("scoped", "structural_scoped") if scoped else ("annotated", "structural")
    todo = [i for i, r in enumerate(train) if not r.get(field)]
    for i, record in zip(todo, annotate_records([train[i] for i in todo], tokenizer, annotator, progress=True)):
      train[i] = record
  if args.objective == "apar_sft":
    from pasta_jax.data.apar_format import apar_records
    train, kinds = apar_records(train)
    print(f"APAR format: {dict(kinds)}")
  if args.only_annotated:
    train = [r for r in train if r.get(annotation_field(args.objective))]
  return train, held_out


def annotation_field(objective: str) -> str:
  return {"apar_sft": "apar", "scoped_sft": "scoped"}.get(objective, "annotated")


def sample_held_out(model_dir, prompts: list[str], out_dir, tokens: int, method: str = "pasta") -> str:
  """Decodes held-out prompts with the trained model (PASTA; APAR for apar_sft; pasta-v0 for scoped_sft)."""
  from pasta_jax.methods import generate
  model = load_model(model_dir)
  results = generate(model, prompts, method, max_new_tokens=tokens, chat=True)
  lines, well_formed = [], 0
  for prompt, result in zip(prompts, results):
    threads = len(result.threads) or len(result.thread_texts)  # a tree-form answer (APAR) has texts, no traces
    tagged = threads > 1
    ok = tagged and not math.isnan(result.theoretical_speedup)
    well_formed += ok
    lines += [f"## {prompt}", "", f"threads: {threads - 1} forks, steps {result.steps}, "
              f"theoretical speedup {result.theoretical_speedup:.2f}, well-formed tags: {ok}", "", "```",
              result.annotated, "```", ""]
  summary = f"{well_formed}/{len(prompts)} held-out answers forked with well-formed tags"
  (out_dir / "samples.md").write_text(f"# Held-out samples\n\n{summary}\n\n" + "\n".join(lines))
  return summary


def main(argv=None) -> int:
  args = parse_args(argv)
  maybe_initialize_distributed(force=args.multi_host)
  config = train_config(args, jax.device_count(), objective=args.objective)
  model = load_model(model_path(args))
  train, held_out = training_records(args, model.tokenizer)
  vocab = tag_vocab_for(model.tokenizer, config.position_mode)
  encode = EncodeConfig(seq_len=config.seq_len, num_threads=config.num_threads, position_mode=config.position_mode,
                        objective=config.objective)
  shard_index, shard_count = batch_slice(config.mesh)  # replicas across hosts feed the same examples
  dataset = layout_dataset(train, model.tokenizer, vocab, encode, batch_size=config.batch_size, seed=config.seed,
                           epochs=config.epochs, shard_index=shard_index, shard_count=shard_count,
                           length_bucket=config.length_bucket)
  annotated = sum(bool(r.get(annotation_field(args.objective))) for r in train)
  print(f"data: {len(train)} records ({annotated} annotated); {dataset.report.summary()}; {len(dataset)} steps")
  out = run_path(args.out)
  result = Trainer(config, model, dataset, out).run(args.stop_after)
  if not is_main_process():
    return 0
  print(f"loss curve: {plot_loss_curve(out)}")
  if result.model_dir is None:
    print(f"stopped after step {result.steps}; run the same command again to resume")
    return 0
  print(f"model: {result.model_dir}")
  if args.sample and held_out and is_remote(args.out):
    print("--sample skipped: the model is remote; load it locally with pasta generate --pasta")
  elif args.sample and held_out:
    from pasta_jax.data.encode import record_prompt
    method = {"apar_sft": "apar", "scoped_sft": "pasta-v0"}.get(args.objective, "pasta")
    print(sample_held_out(result.model_dir, [record_prompt(r) for r in held_out[:args.sample]], out,
                          args.sample_tokens, method))
  return 0


if __name__ == "__main__":
  run_main(main)
