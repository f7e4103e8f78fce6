"""Shared command-line plumbing of the training entry points: config, model, data."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pasta_jax.errors import PastaError
from pasta_jax.model.mesh import MeshConfig, parse_mesh
from pasta_jax.training.config import TrainConfig, load_train_config


def _names(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


OVERRIDES = {  # flag -> (TrainConfig field, type)
  "--batch-size": ("batch_size", int), "--grad-accum": ("grad_accum", int), "--seq-len": ("seq_len", int),
  "--length-bucket": ("length_bucket", int),
  "--num-threads": ("num_threads", int), "--epochs": ("epochs", int), "--max-steps": ("max_steps", int),
  "--lr": ("learning_rate", float), "--save-every": ("save_every", int), "--seed": ("seed", int),
  "--compute-dtype": ("compute_dtype", str), "--param-dtype": ("param_dtype", str),
  "--hardware": ("hardware", str), "--alpha": ("bonbon_alpha", float), "--beta": ("bonbon_beta", float),
  "--position-mode": ("position_mode", str), "--warmup-steps": ("warmup_steps", int),
  # adapters: --lora-rank 16 trains LoRA factors and tag/chat embedding rows over a frozen base
  "--lora-rank": ("lora_rank", int), "--lora-alpha": ("lora_alpha", float),
  "--lora-targets": ("lora_targets", _names), "--train-rows": ("train_rows", _names),
  "--kl-weight": ("kl_weight", float), "--kl-reference": ("kl_reference", str), "--attention": ("attention", str),
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--config", help="a TrainConfig JSON file (tpu_configs/*.json); flags override it")
  parser.add_argument("--model", help="HF folder, .gguf or pasta checkpoint (default: the embedded Gemma 3 270M)")
  parser.add_argument("--out", required=True, help="run directory: checkpoints, metrics, exported model")
  parser.add_argument("--mesh", help="data,fsdp,tensor (e.g. 2,2,2); default: all devices on data")
  parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None)
  parser.add_argument("--multi-host", action="store_true",
                      help="call jax.distributed.initialize() (auto when the environment names several hosts)")
  parser.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this step; schedule unchanged")
  for flag, (_, kind) in OVERRIDES.items():
    parser.add_argument(flag, type=kind)


def train_config(args: argparse.Namespace, device_count: int, **fixed) -> TrainConfig:
  overrides = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in OVERRIDES.items()}
  overrides = {k: v for k, v in overrides.items() if v is not None}
  if args.remat is not None:
    overrides["remat"] = args.remat
  if args.mesh:
    overrides["mesh"] = parse_mesh(args.mesh)
  overrides.update(fixed)
  if args.config:
    config = load_train_config(args.config)
    return config.replace(**overrides)
  overrides.setdefault("mesh", MeshConfig(data=device_count))
  if "hardware" not in overrides:  # the devices at hand (an MFU against the CPU's peak on a GPU is made up)
    from pasta_jax.training.plan import detect_hardware
    overrides["hardware"] = detect_hardware() or "cpu"
  return TrainConfig(**overrides)


def run_main(main) -> None:
  """Runs an entry point; user errors print one line and exit 2, never a traceback."""
  try:
    sys.exit(main())
  except PastaError as err:
    print(f"{Path(sys.argv[0]).stem}: error: {err}", file=sys.stderr)
    sys.exit(2)
  except KeyboardInterrupt:
    print("interrupted: resume by running the same command again", file=sys.stderr)
    sys.exit(130)


def model_path(args) -> str:
  """--model as `load_model` takes it; training starts from the base model unless told otherwise."""
  from pasta_jax.model.load import BASE, SHIPPED
  if args.model and args.model not in (BASE, *SHIPPED) and not os.path.exists(args.model):
    raise PastaError(f"--model {args.model!r} does not exist")
  return args.model or BASE
