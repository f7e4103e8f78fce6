"""Medusa-1 heads for a pasta_jax Gemma, as one resumable command (paper 004's drafter, Medusa-1 recipe).

  python -m train.medusa --out runs/medusa270m

The stages' code is `pasta_jax.training.medusa` (distill, heads, early); this command reads the flags and
runs the stages asked for.

Stages, each resumable, also after a kill at any moment (a finished stage is skipped; `distill` appends and
resumes per batch; every file is written whole, the heads folder published with a completion marker last).
A run folder keeps the settings that decide its data and heads (run.json): a rerun with other ones is refused,
naming them.
  distill  self-distillation data: the model's own greedy answers to training-pool prompts (Medusa-2's advice
           for models whose training data is not at hand), written as token ids to distill.jsonl;
  train    the heads on a frozen base: loss sum_k 0.8^k CE(head_k) (`pasta_jax.model.medusa`), the base's
           hidden states computed once and cached; heads.safetensors + heads.json at the end (--next-token:
           heads that also read the token at t + 1, the tree's root; --width F: each head's block two layers
           wide, D -> F -> D);
  calibrate  per-head top-k hit rates on held-out distilled answers (calibration.json): the tree builder's
           and ProPD's prior;
  early    ProPD's early prediction head (`decode/rules/pruning.py`): the residual stream after --early-layer
           layers -> the next token, over the heads' draft vocabulary, from the logit lens as its start;
           heads/early.safetensors + early.json with the held-out top-K hit rates before and after (over
           this run's heads, or a copy of the model's shipped ones).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pasta_jax.model import medusa, runfiles
from pasta_jax.model.load import load_model
from pasta_jax.training.medusa import distill, early, heads
from train.common import run_main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="train.medusa", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="run directory")
  parser.add_argument("--model", default=None, help="model to train heads for (default: the tuned default)")
  parser.add_argument("--stages", default="distill,train,calibrate")
  parser.add_argument("--prompts", type=int, default=256, help="distillation prompts")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4, help="Medusa heads K")
  parser.add_argument("--next-token", action="store_true",
                      help="heads that also read the token at t + 1, the tree's root (model/medusa.py)")
  parser.add_argument("--width", type=int, default=0,
                      help="each head's block D -> F -> D with F this (0: Medusa's one D x D block; model/medusa.py)")
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--train-batch", type=int, default=128, help="positions per step")
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--draft-vocab", type=int, default=16384,
                      help="tokens the heads rank: the most frequent of the training text (0: all 262k)")
  parser.add_argument("--top-k", type=int, default=10, help="candidates per head kept at calibration")
  parser.add_argument("--held-out", type=float, default=0.1, help="share of distilled answers kept for calibration")
  parser.add_argument("--early-layer", type=int, default=4, help="stage early: the layer ProPD's early head reads")
  parser.add_argument("--early-top-k", type=int, default=50, help="stage early: the list pruning keeps per node")
  return parser.parse_args(argv)


IDENTITY_DEFAULTS = {"width": 0}  # settings added since runs began: what a run folder without them used


def identity(args: argparse.Namespace) -> dict:
  """The settings a resumed run must share with the run in its folder: those that decide the distilled answers,
  the split and the heads (--prompts may grow: the pool prompts are a prefix-stable list; --batch and the
  calibration and early-head flags rerun cheaply or decide nothing kept)."""
  return {"model": args.model, "new_tokens": args.new_tokens, "heads": args.heads, "next_token": args.next_token,
          "width": args.width, "epochs": args.epochs, "train_batch": args.train_batch, "lr": args.lr,
          "draft_vocab": args.draft_vocab, "held_out": args.held_out}


def main(argv=None) -> int:
  args = parse_args(argv)
  out = Path(args.out)
  runfiles.claim(out, identity(args), defaults=IDENTITY_DEFAULTS)
  model = load_model(args.model)
  stages = [s.strip() for s in args.stages.split(",") if s.strip()]
  if "distill" in stages:
    distill.distill(model, out, args.prompts, args.batch, args.new_tokens)
  train_rows, held_rows = distill.split(distill.read_distilled(out / "distill.jsonl"), args.held_out)
  if "train" in stages and not heads.heads_done(out):
    config = medusa.MedusaConfig(num_heads=args.heads, next_token=args.next_token, width=args.width)
    meta = heads.train_heads(model, train_rows, out, config, args.epochs, args.train_batch, args.lr, args.draft_vocab)
    print(f"heads: {meta['steps']} steps, loss {meta['first_loss'][0]:.3f} -> {meta['last_loss'][0]:.3f}")
  if "calibrate" in stages:
    info = heads.calibrate(model, held_rows, out, args.top_k)
    print("top-1 hit rate per head:", " ".join(f"{x:.3f}" for x in info["top1"]))
  if "early" in stages:
    early.heads_folder(model, out)
    meta = early.train_early_head(model, train_rows, held_rows, out, args.early_layer, args.early_top_k, args.epochs,
                                  args.train_batch, args.lr)
    rates = meta["held_out_top_k_hit_rate"]
    print(f"early head, layer {args.early_layer}: next token in the top {args.early_top_k} "
          f"{rates['logit_lens']:.3f} (logit lens) -> {rates['trained']:.3f} (trained)")
  return 0


if __name__ == "__main__":
  run_main(main)
