"""An eval run's folder, so an interrupted run resumes.

  run.json       what identifies the run (prompt source, decode settings, default model): a rerun with
                 other settings into the same folder is refused, since its timings would not compare
  partial.jsonl  one line per finished (method, prompt) decode, appended as each finishes
Methods and --limit may change between reruns: finished decodes are keyed by (method label, prompt id).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pasta_jax.errors import PastaError
from pasta_jax.eval.methods import MethodOutput

RUN_FILE = "run.json"
PARTIAL_FILE = "partial.jsonl"


class RunDirError(PastaError):
  """--out holds a different run, or files that cannot be read."""


class RunStore:
  def __init__(self, out_dir: str | Path):
    self.dir = Path(out_dir)
    self.partial = self.dir / PARTIAL_FILE

  def claim(self, identity: dict) -> None:
    """Creates the folder for this run, or checks that the run already in it is the same one."""
    try:
      self.dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      raise RunDirError(f"cannot create --out folder {self.dir}: {err.strerror}") from None
    run_file = self.dir / RUN_FILE
    if run_file.exists():
      try:
        previous = json.loads(run_file.read_text())
      except (OSError, json.JSONDecodeError) as err:
        raise RunDirError(f"cannot read {run_file} ({err}); use another --out") from None
      changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
      if changed:
        diffs = "; ".join(f"{k}: {previous.get(k)!r} then, {identity.get(k)!r} now" for k in changed)
        raise RunDirError(f"{self.dir} holds a run with other settings ({diffs}); use another --out or the same "
                          "settings")
    else:
      run_file.write_text(json.dumps(identity, indent=2) + "\n")

  def finished(self) -> dict[tuple[str, str], MethodOutput]:
    """Finished decodes by (method label, prompt id); a line cut off by an interruption is skipped."""
    done: dict[tuple[str, str], MethodOutput] = {}
    if not self.partial.exists():
      return done
    text = self.partial.read_text()
    if text and not text.endswith("\n"):  # end the half-written line, so the next append starts clean
      with open(self.partial, "a") as f:
        f.write("\n")
    for line in text.splitlines():
      try:
        row = json.loads(line)
        done[(row["method"], row["id"])] = MethodOutput(**row["output"])
      except (json.JSONDecodeError, KeyError, TypeError):
        continue  # the last line of a killed run, half written
    return done

  def append(self, method: str, prompt_id: str, output: MethodOutput) -> None:
    line = json.dumps(dict(method=method, id=prompt_id, output=dataclasses.asdict(output)))
    with open(self.partial, "a") as f:
      f.write(line + "\n")
      f.flush()
