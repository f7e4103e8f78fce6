"""Start-up of the README's first line: wall seconds of whole `pasta generate` processes, side by side.

  python -m bench.startup [--repeats 3] [--out docs/results/startup_cpu.txt]

Four settings, each run `--repeats` times as a new process (the same command every time):
- off: `pasta --no-compile-cache generate ...`, every process traces, lowers and compiles its decode loop,
  measures the output head's plan and converts the weights to the decode layout (what every run cost before the
  cache); the weights' caches beside the GGUF are warm;
- fresh: every cache in new empty folders ($PASTA_COMPILE_CACHE and $PASTA_JAX_CACHE): a user's very first run
  on a new machine, which also dequantizes the GGUF, builds the tokenizer and folds the adapter;
- first: the compile cache in a new empty folder, the weights' caches warm (the first run after an upgrade);
- second: every cache filled by an earlier run of the same command, each measured run right after an unmeasured
  run of it (the user's second run; a first or fresh run before it writes gigabytes, which a small VM's page cache
  would otherwise have to make room for).
The answer printed must be the same in every run. Also reported: each setting's own "compile/setup" seconds as
the command prints them, and the share of the second run that is not decoding.

Last line: RESULT second_s=<median> first_s=<median> fresh_s=<median> off_s=<median> second_over_off=<ratio>
  same_answer=<bool>
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm


def machine_line() -> str:
  return f"{platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"


COMMAND = ["generate", "Give three tips for staying healthy.", "--pasta", "--max-new-tokens", "96"]
SETUP = re.compile(r"over ([0-9.]+)s \(\+([0-9.]+)s compile/setup\)")


def run_once(cache: Path | None, weights: Path | None = None) -> tuple[float, str, float, float]:
  """(wall seconds, the answer printed, decode seconds, compile/setup seconds) of one `pasta generate` process;
  cache: its compile cache folder (None: off); weights: its weights' cache folder (None: the default one)."""
  env = dict(os.environ)
  argv = [sys.executable, "-m", "pasta_jax.cli"]
  if cache is None:
    argv.append("--no-compile-cache")
  else:
    env["PASTA_COMPILE_CACHE"] = str(cache)
  if weights is not None:
    env["PASTA_JAX_CACHE"] = str(weights)
  start = time.perf_counter()
  done = subprocess.run(argv + COMMAND, env=env, capture_output=True, text=True, timeout=1200)
  wall = time.perf_counter() - start
  if done.returncode != 0:
    raise SystemExit(f"pasta generate failed: {done.stderr[-2000:]}")
  found = SETUP.search(done.stderr + done.stdout)
  decode, setup = (float(found.group(1)), float(found.group(2))) if found else (float("nan"), float("nan"))
  return wall, done.stdout.split("\n\nthreads")[0], decode, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.startup", description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None, help="also write the report here (e.g. docs/results/startup_cpu.txt)")
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  runs: dict[str, list[tuple[float, str, float, float]]] = {"off": [], "fresh": [], "first": [], "second": []}
  with tempfile.TemporaryDirectory() as root, tqdm(total=4 * args.repeats, unit="run", desc="startup") as bar:
    warm = Path(root) / "warm"
    run_once(warm)  # fills the second runs' folder (not measured)
    for i in range(args.repeats):  # interleaved, so a slow spell of the machine costs every setting alike
      settings = (("off", None, None), ("fresh", Path(root) / f"fresh{i}", Path(root) / f"fresh_weights{i}"),
                  ("first", Path(root) / f"first{i}", None), ("second", warm, None))
      for name, cache, weights in settings:
        if name == "second":
          run_once(warm)  # what a second run follows: a run of the same command (not measured)
        runs[name].append(run_once(cache, weights))
        bar.update()
        for folder in (cache, weights):
          if folder is not None and folder != warm:
            shutil.rmtree(folder, ignore_errors=True)  # gigabytes of converted weights

  med = {name: statistics.median(r[0] for r in rows) for name, rows in runs.items()}
  same = len({r[1] for rows in runs.values() for r in rows}) == 1
  lines = [f"# bench.startup, {time.strftime('%Y-%m-%d')}, {machine_line()}",
           f"# python -m bench.startup --repeats {args.repeats}: pasta {' '.join(COMMAND[:1])} "
           f"{COMMAND[1]!r} {' '.join(COMMAND[2:])}"]
  for name, rows in runs.items():
    walls = ", ".join(f"{r[0]:.1f}" for r in rows)
    setup = statistics.median(r[3] for r in rows)
    decode = statistics.median(r[2] for r in rows)
    lines.append(f"{name:>6}: wall median {med[name]:.1f} s ({walls}); decode {decode:.1f} s, "
                 f"compile/setup {setup:.1f} s as printed")
  lines.append(f"RESULT second_s={med['second']:.1f} first_s={med['first']:.1f} fresh_s={med['fresh']:.1f} "
               f"off_s={med['off']:.1f} "
               f"second_over_off={med['second'] / med['off']:.2f} same_answer={same}")
  report = "\n".join(lines) + "\n"
  print(report, end="")
  if args.out:
    Path(args.out).write_text(report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
