"""`pasta plan CONFIG`: print the per-device memory plan of a training or decode config (tpu_configs/); exit 0
if it fits, 1 if not."""

from __future__ import annotations

import argparse
import sys

FITS, DOES_NOT_FIT = 0, 1

# flag -> TrainConfig field (the same overrides the training entry points take)
OVERRIDES = {
  "--model": ("model", str), "--objective": ("objective", str), "--hardware": ("hardware", str),
  "--batch-size": ("batch_size", int), "--grad-accum": ("grad_accum", int), "--seq-len": ("seq_len", int),
  "--num-threads": ("num_threads", int), "--compute-dtype": ("compute_dtype", str),
  "--param-dtype": ("param_dtype", str), "--mu-dtype": ("mu_dtype", str), "--lora-rank": ("lora_rank", int),
}


def add_plan_parser(sub) -> None:
  plan = sub.add_parser("plan", help="per-device memory plan of a training or decode config (exit 1 if it does "
                                    "not fit)")
  plan.add_argument("config", help="a TrainConfig JSON file or a decode config (tpu_configs/*.json)")
  plan.add_argument("--mesh", help="data,fsdp,tensor (e.g. 1,4,2)")
  plan.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None)
  for flag, (_, kind) in OVERRIDES.items():
    plan.add_argument(flag, type=kind)


def overrides_from(args: argparse.Namespace) -> dict:
  from pasta_jax.model.mesh import parse_mesh

  fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in OVERRIDES.items()}
  if args.mesh:
    fields["mesh"] = parse_mesh(args.mesh)
  fields["remat"] = args.remat
  return {k: v for k, v in fields.items() if v is not None}


def run_plan(args: argparse.Namespace) -> int:
  from pasta_jax.training.decode_plan import is_decode_config
  if is_decode_config(args.config):
    return run_decode_plan(args)
  from pasta_jax.training.config import load_train_config
  from pasta_jax.training.plan import format_plan, plan_for

  plan = plan_for(load_train_config(args.config, **overrides_from(args)))
  return report(format_plan(plan), plan)


def report(table: str, plan) -> int:
  """Prints a plan's table; exit status FITS, or DOES_NOT_FIT with the reason on stderr."""
  print(table)
  if plan.fits:
    return FITS
  print(f"pasta: does not fit: {plan.reason()}", file=sys.stderr)
  return DOES_NOT_FIT


def run_decode_plan(args: argparse.Namespace) -> int:
  """A decode config (`"kind": "decode"`): per-chip weights, pool and activations of sharded decoding."""
  from pasta_jax.model.mesh import parse_mesh
  from pasta_jax.training.decode_plan import decode_plan, format_decode_plan, load_decode_config
  config = load_decode_config(args.config)
  if args.mesh:
    import dataclasses
    config = dataclasses.replace(config, mesh=parse_mesh(args.mesh).shape)
  plan = decode_plan(config)
  return report(format_decode_plan(plan), plan)
