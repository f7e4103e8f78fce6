"""Kernels a decode step launches, read from XLA's optimized HLO: what a profiler cannot show once the loop runs
as a CUDA graph (pasta_jax/xla_flags.py), where a trace holds one graph launch per step, not its kernels.

With no files it compiles, on this machine's backend, plain decoding and the PASTA interpreter replaying
bench.synthetic's one-block answer on random weights in a preset's real shapes (as bench.seq_cost times them),
and reads their compiled programs. Or give it modules that XLA dumped
(XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text": the `*jit_prefill_and_run*after_optimizations.txt` files).
For the outermost while loop of each (the decode loop) it counts the instructions of one iteration that launch
work: fusions, library calls, copies. A nested loop counts its body times its known trip count, a call what it
calls, and a conditional each branch apart (lane buckets: the branch a step takes). Parameters, tuples, bitcasts
and constants launch nothing. On a CPU the counts are XLA:CPU's thunks, not a GPU's kernels.

  python -m bench.loop_kernels [FILE ...] [--config gemma3-270m] [--dtype float32] [--tokens 64] [--lanes 8]
Last line: RESULT kernels=<each program's step through its first branches, comma-separated>
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re

LAUNCHES_NOTHING = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
                              "add-dependency", "opt-barrier", "partition-id", "replica-id"})
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = .+? ([\w\-]+)\(")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  op: str
  text: str


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """(computation name -> its instructions, the entry computation's name) of an HLO text module."""
  computations, current, entry = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line) if not line.startswith(" ") else None
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (found := _INSTRUCTION.match(line)):
      computations[current].append(Instruction(found.group(1), found.group(2), line.strip()))
  if entry is None:
    raise ValueError("no ENTRY computation: is this an HLO text module?")
  return computations, entry


def family(name: str) -> str:
  """A kernel's or instruction's name without its numbers: loop_add_fusion_12 -> loop_add_fusion."""
  return re.sub(r"[._]?\d+", "", name.split("(")[0]) or name


def branches_of(instruction: Instruction) -> list[str]:
  listed = re.search(r"branch_computations=\{([^}]*)\}", instruction.text)
  if listed:
    return [name.strip().lstrip("%") for name in listed.group(1).split(",")]
  return [re.search(rf"{side}_computation=%?([\w.\-]+)", instruction.text).group(1) for side in ("true", "false")]


def trip_count(instruction: Instruction) -> int:
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instruction.text)
  return int(known.group(1)) if known else 1


def launches(computations, name: str) -> tuple[collections.Counter, list[collections.Counter]]:
  """(kernels by kind outside conditionals, [one Counter per branch] of each conditional) of one run of `name`.
  A kind is the instruction's `family`."""
  outside, branches = collections.Counter(), []
  for ins in computations[name]:
    if ins.op in LAUNCHES_NOTHING:
      continue
    if ins.op == "while":
      body = re.search(r"body=%?([\w.\-]+)", ins.text).group(1)
      inner, inner_branches = launches(computations, body)
      for kind, n in inner.items():
        outside[kind] += n * trip_count(ins)
      outside["while-condition"] += trip_count(ins) + 1
      branches.extend(inner_branches)
    elif ins.op == "call":  # XLA:CPU wraps some loops in calls; a call itself launches nothing
      inner, inner_branches = launches(computations, re.search(r"to_apply=%?([\w.\-]+)", ins.text).group(1))
      outside += inner
      branches.extend(inner_branches)
    elif ins.op == "conditional":
      outside["conditional"] += 1
      branches.append([sum_branch(computations, b) for b in branches_of(ins)])
    else:
      outside[family(ins.name)] += 1
  return outside, branches


def sum_branch(computations, name: str) -> collections.Counter:
  inner, inner_branches = launches(computations, name)
  for branch_set in inner_branches:  # a conditional inside a branch: count its largest branch
    inner += max(branch_set, key=lambda c: sum(c.values()))
  return inner


def decode_loop(computations, entry: str) -> str:
  loops = [ins for ins in computations[entry] if ins.op == "while"]
  if not loops:
    raise ValueError("the ENTRY computation has no while loop: not a decode module?")
  return re.search(r"body=%?([\w.\-]+)", max(loops, key=lambda i: len(i.text)).text).group(1)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.loop_kernels", description=__doc__.split("\n\n")[0])
  parser.add_argument("files", nargs="*", help="optimized HLO text modules (default: compile plain and PASTA here)")
  parser.add_argument("--config", default="gemma3-270m")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--tokens", type=int, default=64, help="the replayed answer's tokens (sizes the pool)")
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--top", type=int, default=8, help="kernel kinds to list outside the conditionals")
  return parser.parse_args(argv)


def compiled_programs(args) -> dict[str, str]:
  """{label: optimized HLO text} of plain decoding and the PASTA interpreter, compiled on this backend."""
  import jax
  import jax.numpy as jnp

  from bench.synthetic import TEXT, answers, random_model
  from pasta_jax.decode import api, loop
  from pasta_jax.decode.runtime import Runtime
  from pasta_jax.methods import Pasta, Sequential, prepare_run

  dtype = jnp.dtype(args.dtype)
  model = random_model(args.config, dtype)
  print(f"device: {jax.devices()[0].device_kind}; {args.config} random weights, {args.dtype}")
  prompt = [model.tokenizer.encode("question: " + TEXT)]
  kw = dict(max_new_tokens=args.tokens + 64, runtime=Runtime(dtype=dtype), forced_answers=[answers(args.tokens, 1)[0]])
  programs = {}
  for label, method in (("plain", Sequential()), ("pasta", Pasta(lanes=args.lanes))):
    prep = prepare_run(model, prompt, method, **kw)
    programs[label] = api.COMPILED.get(prep, loop.prefill_and_run).as_text()  # the program generate would run
  return programs


def main(argv=None):
  args = parse_args(argv)
  if args.files:
    programs = {}
    for path in args.files:
      with open(path) as f:
        programs[path] = f.read()
  else:
    programs = compiled_programs(args)
  firsts = []
  for label, text in programs.items():
    computations, entry = parse_module(text)
    outside, branches = launches(computations, decode_loop(computations, entry))
    per_branch = [[sum(c.values()) for c in branch_set] for branch_set in branches]
    first = sum(outside.values()) + sum(counts[0] for counts in per_branch)
    firsts.append(first)
    print(f"{label}: {sum(outside.values())} kernels a step outside conditionals; conditionals' branches "
          f"{per_branch or 'none'}; a step through each first branch: {first}")
    print("   " + ", ".join(f"{kind} {n}" for kind, n in outside.most_common(args.top)))
  print("RESULT kernels=" + ",".join(str(n) for n in firsts))


if __name__ == "__main__":
  main()
