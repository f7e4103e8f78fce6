"""Where the test suite's time goes: a pytest plugin that records, per test, the seconds JAX spent tracing,
lowering and compiling (`jax.monitoring`'s duration events) and the memory maps its worker holds, then a report.

  SUITE_PROFILE=runs/suite_profile.jsonl python -m pytest -q -n 2 -p bench.suite_profile
  python -m bench.suite_profile --profile runs/suite_profile.jsonl

Profiled this way (2026-11-28), 60% of the suite's test time was XLA:CPU's backend compile (tests/conftest.py's
flags then halved it) and that the worker crash every run had was its memory maps reaching the kernel's limit.
Last line: `RESULT test_s=... compile_s=... compile_share=... peak_maps=...`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

from pasta_jax.serve.programs import memory_maps

ENV = "SUITE_PROFILE"  # the JSONL the plugin appends to
DEFAULT_OUT = "runs/suite_profile.jsonl"
PHASES = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile"}


class Recorder:
  """Sums JAX's duration events between two tests; one JSON row per test."""

  def __init__(self, out_path: str):
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    self.out = open(out_path, "a")  # noqa: SIM115 (open for the whole session, one row a test)
    self.seconds: collections.Counter = collections.Counter()
    self.counts: collections.Counter = collections.Counter()

  def listen(self, event: str, duration: float, **_) -> None:
    phase = PHASES.get(event.rsplit("/", 1)[-1])
    if phase:
      self.seconds[phase] += duration
      self.counts[phase] += 1

  def write(self, nodeid: str, wall: float) -> None:
    row = {"test": nodeid, "wall": round(wall, 3), "pid": os.getpid(), "maps": memory_maps()[0],
           **{phase: round(s, 3) for phase, s in self.seconds.items()},
           **{phase + "_n": n for phase, n in self.counts.items()}}
    self.out.write(json.dumps(row) + "\n")
    self.out.flush()
    self.seconds.clear()
    self.counts.clear()


_recorder: Recorder | None = None


def pytest_configure(config):
  """Registers the listener only where pytest loads this module as a plugin (`-p bench.suite_profile`)."""
  global _recorder
  import jax.monitoring

  _recorder = Recorder(os.environ.get(ENV, DEFAULT_OUT))
  jax.monitoring.register_event_duration_secs_listener(_recorder.listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  start = time.perf_counter()
  yield
  if _recorder is not None:
    _recorder.write(item.nodeid, time.perf_counter() - start)


def summarize(rows: list[dict], top: int = 20) -> tuple[list[str], dict]:
  """Per-file totals (slowest first) and the suite's totals."""
  files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for row in rows:
    totals = files[row["test"].split("::")[0]]
    totals["wall"] += row["wall"]
    totals["tests"] += 1
    for phase in PHASES.values():
      totals[phase] += row.get(phase, 0.0)
      totals[phase + "_n"] += row.get(phase + "_n", 0)
  suite = collections.Counter()
  for totals in files.values():
    suite.update(totals)
  peak = collections.defaultdict(int)
  for row in rows:
    peak[row["pid"]] = max(peak[row["pid"]], row["maps"])
  lines = [f"{'test s':>8} {'compile s':>10} {'compiles':>8} {'lower s':>8} {'trace s':>8} {'tests':>5}  file"]
  for name, t in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:top]:
    lines.append(f"{t['wall']:8.1f} {t['compile']:10.1f} {t['compile_n']:8d} {t['lower']:8.1f} {t['trace']:8.1f} "
                 f"{t['tests']:5d}  {name}")
  totals = dict(test_s=suite["wall"], compile_s=suite["compile"], lower_s=suite["lower"], trace_s=suite["trace"],
                compiles=suite["compile_n"], tests=suite["tests"], peak_maps=max(peak.values(), default=0),
                workers=len(peak))
  return lines, totals


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="bench.suite_profile", description=__doc__.split("\n\n")[0])
  parser.add_argument("--profile", default=DEFAULT_OUT, help="the JSONL the plugin wrote")
  parser.add_argument("--top", type=int, default=20, help="files to list, slowest first")
  return parser.parse_args(argv)


def main(argv=None) -> None:
  args = parse_args(argv)
  rows = [json.loads(line) for line in Path(args.profile).read_text().splitlines() if line.strip()]
  lines, t = summarize(rows, args.top)
  print("\n".join(lines))
  share = t["compile_s"] / t["test_s"] if t["test_s"] else float("nan")
  print(f"{t['tests']} tests over {t['workers']} worker(s): {t['test_s']:.0f} s of test time; compile "
        f"{t['compile_s']:.0f} s ({t['compiles']} programs), lowering {t['lower_s']:.0f} s, "
        f"tracing {t['trace_s']:.0f} s")
  print(f"RESULT test_s={t['test_s']:.0f} compile_s={t['compile_s']:.0f} compile_share={share:.2f} "
        f"peak_maps={t['peak_maps']}")


if __name__ == "__main__":
  main()
