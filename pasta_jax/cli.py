"""`pasta` command line. Errors a user can fix print one line and exit nonzero, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pasta_jax.commands.method_flags import add_method_flags
from pasta_jax.errors import PastaError
from pasta_jax.methods.registry import names
from pasta_jax.model import user_cache


def _add_sampling(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--repetition-penalty", type=float, default=None,
                      help="> 1 discourages tokens each thread already sees (CTRL's penalty; tags exempt); 1 = off "
                           "(default: the model's generation.json, else off)")
  parser.add_argument("--distinct-topics", action=argparse.BooleanOptionalAction, default=None,
                      help="PASTA: main may not close a promise on a topic it already used, so sibling blocks do "
                           "not start alike (default: the model's generation.json, else off)")
  parser.add_argument("--fork-bias", type=float, default=0.0, metavar="X",
                      help="PASTA's speed/quality knob: X is added to the logit of the token that opens a promise, "
                           "where main may open one (> 0: more forks, faster; < 0: fewer; 0 = off, the default)")
  parser.add_argument("--max-topic-tokens", type=int, default=0, metavar="N",
                      help="PASTA: a promise's topic has at most N tokens, then main must close it (each cut is "
                           "counted); 0 = no cap, the default")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="pasta", description="PASTA learned asynchronous decoding in JAX.")
  parser.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                      help="keep compiled decode loops and this machine's measured head plan in the user's cache "
                           f"(~/.cache/pasta_jax, or ${user_cache.ENV}; 'off' there turns it off), so a second run "
                           "skips compiling (default: on)")
  sub = parser.add_subparsers(dest="command", required=True)
  gen = sub.add_parser("generate", help="decode a prompt (plain, or PASTA with --pasta)")
  gen.add_argument("prompt")
  gen.add_argument("--model", default=None,
                   help="base, pasta-sft, pasta-bon, baseline-sft, an adapter folder, HF folder, .gguf file or "
                        "Orbax checkpoint (default: the tuned PASTA adapter on the embedded Gemma 3 270M)")
  gen.add_argument("--max-new-tokens", type=int, default=128)
  gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in Gemma's chat turns (default: on for tuned adapters, which were "
                        "trained on chat turns; off for a base model, which continues plain text)")
  gen.add_argument("--pasta", action="store_true", help="decode with the PASTA interpreter and show threads "
                                                        "(= --method pasta)")
  add_method_flags(gen, names(needs_scripts=False), "default: the model's generation.json (the tuned default: "
                                                    "pasta), else sequential")
  gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  gen.add_argument("--certify-head", action="store_true",
                   help="greedy: multiply the output head in int8 (bfloat16 off a CPU) and certify each choice "
                        "against float32 (the float32 tokens; faster on a CPU when a step has 2-3 rows: PASTA's "
                        "forks, trees)")
  gen.add_argument("--mesh", default=None,
                   help="decode sharded on data,fsdp,tensor devices (e.g. 1,1,4: the weights split 4 ways; "
                        "docs/tpu.md); default: one device")
  gen.add_argument("--multi-host", action="store_true",
                   help="call jax.distributed.initialize() first (auto when the environment names several hosts)")
  _add_sampling(gen)
  from pasta_jax.commands.plan import add_plan_parser

  add_plan_parser(sub)
  from pasta_jax.commands.eval import build_eval_parser

  build_eval_parser(sub)
  from pasta_jax.commands.annotate import add_annotate_parser
  from pasta_jax.commands.data_stats import add_stats_parser

  add_annotate_parser(sub)
  add_stats_parser(sub)
  from pasta_jax.commands.ngram import add_ngram_parser

  add_ngram_parser(sub)
  from pasta_jax.commands.serve import add_serve_parser

  add_serve_parser(sub)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    if not args.compile_cache:
      user_cache.turn_off()
    if args.command == "generate":
      from pasta_jax.commands.generate import run_generate

      return run_generate(args)
    if args.command == "eval":
      from pasta_jax.commands.eval import run_eval

      return run_eval(args)
    if args.command == "plan":
      from pasta_jax.commands.plan import run_plan

      return run_plan(args)
    if args.command == "annotate":
      from pasta_jax.commands.annotate import run_annotate

      return run_annotate(args)
    if args.command == "ngram":
      from pasta_jax.commands.ngram import run_ngram

      return run_ngram(args)
    if args.command == "serve":
      from pasta_jax.commands.serve import run_serve

      return run_serve(args)
    if args.command == "data-stats":
      from pasta_jax.commands.data_stats import run_stats_command

      return run_stats_command(args)
  except PastaError as err:
    print(f"pasta: error: {err}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("pasta: interrupted", file=sys.stderr)
    return 130
  return 0


def entry() -> None:
  """The `pasta` console command: `main`, then an exit that skips tearing the interpreter down.

  Everything a command writes is written and closed before `main` returns; what is left is freeing the compiled
  programs and gigabytes of weights one object at a time (JAX's exit hook, then the modules), which took 1.3 s
  of a 13 s `pasta generate`. The operating system takes the memory back at once."""
  try:
    code = main()
  except BrokenPipeError:  # the reader of our output went away (`| head`): not an error worth a traceback
    code = 1
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # a reader that went away (`| head`): nothing left to tell it
      pass
  os._exit(code)


if __name__ == "__main__":
  entry()
