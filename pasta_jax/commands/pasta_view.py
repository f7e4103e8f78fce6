"""`pasta generate --pasta` (or `--method pasta-v0`): decode with the interleaved interpreter, show its threads.

Prints the clean answer, then one row per thread: lane, spawn -> finish steps, content tokens and a
text Gantt chart over the steps (`█` feeds, `▒` main waits at a sync or its end, `░` main stalls
for a free lane), then steps, stalls, theoretical speedup and realized tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from pasta_jax.decode.result import PastaResult, ThreadTrace
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.state import STEP, THREAD, TOKEN
from pasta_jax.lang.tags import TagVocab
from pasta_jax.methods import Method, generate_ids

CHART_WIDTH = 60
FEED, WAIT, STALL, IDLE = "█", "▒", "░", " "
_RANK = {FEED: 3, WAIT: 2, STALL: 1, IDLE: 0}


def main_states(result: PastaResult, vocab: TagVocab) -> dict[int, str]:
  """Steps where main does not feed: WAIT (pending `<sync/>`, `</scope>` or end) or STALL (pending LENGTH or
  `<promise/>`: no free lane)."""
  records = result.records
  main = records[records[:, THREAD] == 0]
  states = {}
  for k, row in enumerate(main):
    start = int(row[STEP]) + 1
    stop = int(main[k + 1, STEP]) if k + 1 < len(main) else result.steps + 1
    token = int(row[TOKEN])
    waits = token in (vocab.sync, vocab.scope_close) or token in vocab.eos_ids
    mark = WAIT if waits else STALL if vocab.is_length(token) or token == vocab.bare_promise else None
    for step in range(start, stop):
      if mark:
        states[step] = mark
  return states


def step_marks(trace: ThreadTrace, steps: int, waits: dict[int, str]) -> list[str]:
  """One mark per step 1..steps for this thread."""
  fed = set(trace.fed_steps)
  return [FEED if s in fed else waits.get(s, IDLE) for s in range(1, steps + 1)]


def compress(marks: list[str], width: int = CHART_WIDTH) -> str:
  """Fits the per-step marks into `width` columns; a column shows its strongest mark."""
  if len(marks) <= width:
    return "".join(marks)
  per = math.ceil(len(marks) / width)
  return "".join(max(marks[i: i + per], key=_RANK.__getitem__) for i in range(0, len(marks), per))


def trace_lines(result: PastaResult, vocab: TagVocab) -> list[str]:
  waits = main_states(result, vocab)
  lines = []
  for trace in result.threads:
    name = "main" if trace.thread == 0 else f"fork {trace.thread}"
    finish = "…" if trace.finish_step is None else str(trace.finish_step)
    bar = compress(step_marks(trace, result.steps, waits if trace.thread == 0 else {}))
    lines.append(f"{name:>8} lane {trace.lane}  {trace.spawn_step:>4}→{finish:<4} {trace.tokens:>4} tok |{bar}|")
  return lines


def summary(result: PastaResult, compile_seconds: float) -> str:
  rate = result.content_tokens / result.seconds if result.seconds > 0 else 0.0
  state = "finished" if result.finished else result.stop_note
  speedup = result.theoretical_speedup
  # nan: the cut left a block open, so the answer has no critical path to measure
  theoretical = "n/a (cut inside a block)" if math.isnan(speedup) else f"{speedup:.2f}x"
  refused = f"; {result.refusals} {result.refused}" if result.refusals else ""  # what a limit held back, said
  return (f"[{state}{refused}; {result.steps} steps, {result.stalls} stalls, syncs at {list(result.sync_steps)}; "
          f"{result.content_tokens} tokens ({result.tokens} with tags); theoretical speedup "
          f"{theoretical}; realized {rate:.1f} tok/s over {result.seconds:.2f}s "
          f"(+{compile_seconds:.1f}s compile/setup)]")


@dataclasses.dataclass(frozen=True)
class Run:
  """One `pasta generate` decode: the prepared method and the shared settings."""

  model: object
  prompt_ids: list[int]
  method: Method
  max_new_tokens: int
  sampling: SamplingConfig
  runtime: Runtime


def run_pasta(run: Run) -> int:
  """Prints the answer, its thread chart and a summary (and, for a method with trees, what the trees did)."""
  start = time.perf_counter()
  [result] = generate_ids(run.model, [run.prompt_ids], run.method, max_new_tokens=run.max_new_tokens,
                          sampling=run.sampling, runtime=run.runtime)
  setup = time.perf_counter() - start - result.seconds
  vocab = run.model.tokenizer.tag_vocab()
  print(result.text)
  print()
  print(f"threads (steps 1..{result.steps}; {FEED} feeds, {WAIT} waits at a sync, {STALL} stalls):")
  for line in trace_lines(result, vocab):
    print(line)
  print(summary(result, setup), file=sys.stderr)
  if result.speculation:
    print(speculation_line(run.method.name, result.speculation), file=sys.stderr)
  return 0


def speculation_line(method: str, spec: dict) -> str:
  """What the trees did: tokens per tree step; for medusa / propd also the heads' hit rates and the sizes."""
  line = f"[{method}: {spec['accept_length']:.2f} tokens per tree step over {spec['tree_steps']} steps"
  if "head_top1" in spec:
    sizes = " ".join(f"{k}:{v}" for k, v in spec["tree_sizes"].items() if v)
    line += f"; head top-1 hit rates {' '.join(f'{x:.2f}' for x in spec['head_top1'])}; tree sizes {sizes}"
  return line + "]"
