"""An eval run's folder, so an interrupted run resumes.

  run.json       what identifies the run (prompt source, decode settings, default model): a rerun with
                 other settings into the same folder is refused, since its timings would not compare
  partial.jsonl  one line per finished (method, prompt) decode, appended as each finishes
Methods and --limit may change between reruns: finished decodes are keyed by (method label, prompt id).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pasta_jax.eval.methods import MethodOutput
from pasta_jax.model import runfiles
from pasta_jax.model.runfiles import RunDirError  # noqa: F401  (re-exported: callers catch it from here)

RUN_FILE = "run.json"
PARTIAL_FILE = "partial.jsonl"


class RunStore:
  def __init__(self, out_dir: str | Path):
    self.dir = Path(out_dir)
    self.partial = self.dir / PARTIAL_FILE

  def claim(self, identity: dict) -> None:
    """Creates the folder for this run, or checks that the run already in it is the same one."""
    runfiles.claim(self.dir, identity, RUN_FILE)

  def finished(self) -> dict[tuple[str, str], MethodOutput]:
    """Finished decodes by (method label, prompt id); a line cut off by an interruption is skipped."""
    done: dict[tuple[str, str], MethodOutput] = {}
    for row in runfiles.read_rows(self.partial):
      try:
        done[(row["method"], row["id"])] = MethodOutput(**row["output"])
      except (KeyError, TypeError):
        continue
    return done

  def append(self, method: str, prompt_id: str, output: MethodOutput) -> None:
    runfiles.append_row(self.partial, dict(method=method, id=prompt_id, output=dataclasses.asdict(output)))
