"""Every resumable stage survives a SIGKILL: killed at chosen writes, resumed, it ends with the files of a run never
killed.

Each stage (tests/kill_worker.py, on the tiny model) runs in a subprocess that SIGKILLs itself at a write named by
$PASTA_KILL_AT (`runfiles.kill_due`: the state a kill there leaves, e.g. half of an appended row or a finished
temporary file not yet renamed); the next subprocess resumes it and is killed at the next point, and the last resume
runs here. Meanwhile this process runs the same stage uninterrupted, and the two folders must match: byte for byte
where the stage is deterministic, loaded arrays for checkpoints, parsed rows (less wall-clock fields) for metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from pasta_jax.model import runfiles
from tests import kill_worker
from tests.marks import HEAVY

ROOT = Path(__file__).resolve().parent.parent
CLOCK_FIELDS = {"time", "step_seconds", "tokens_per_s", "valid_tokens_per_s", "mfu"}  # differ between any two runs


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
  return kill_worker.save_tiny(tmp_path_factory.mktemp("tiny") / "tiny.msgpack")


def _killed_runs(stage: str, out: Path, kills: list[str], tiny: Path) -> None:
  for spec in kills:
    env = {**os.environ, runfiles.KILL_ENV: spec, kill_worker.TINY_ENV: str(tiny)}
    done = subprocess.run([sys.executable, "-m", "tests.kill_worker", stage, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, (f"{stage} was not killed at {spec} (exit {done.returncode}):\n"
                                                f"{done.stderr[-3000:]}")


def killed_and_straight(stage: str, tmp_path: Path, kills: list[str], tiny: Path) -> tuple[Path, Path]:
  """(folder of the run killed at each of `kills` in turn and resumed, folder of a run never killed)."""
  killed, straight = tmp_path / "killed", tmp_path / "straight"
  with ThreadPoolExecutor(1) as pool:
    chain = pool.submit(_killed_runs, stage, killed, kills, tiny)
    kill_worker.run(stage, straight)
    chain.result()
  kill_worker.run(stage, killed)
  return killed, straight


def file_bytes(folder: Path, skip=("checkpoints", "tensorboard")) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
          if p.is_file() and not set(p.relative_to(folder).parts) & set(skip)}


def assert_no_leftovers(folder: Path) -> None:
  """No temporary file or folder of a killed writer outlives the resume."""
  left = [str(p) for p in folder.rglob(".*") if "checkpoints" not in p.parts]
  assert not left, left


def assert_same_metrics(killed: Path, straight: Path) -> None:
  rows = [[{k: v for k, v in row.items() if k not in CLOCK_FIELDS} for row in runfiles.read_rows(f / "metrics.jsonl")]
          for f in (killed, straight)]
  assert rows[0] == rows[1] and [r["step"] for r in rows[0]] == list(range(len(rows[0])))


def assert_same_arrays(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@HEAVY  # the same resume machinery (runfiles) as the SFT and preference kills below
def test_recipe_records_survive_kills(tmp_path, tiny_file):
  killed, straight = killed_and_straight("records", tmp_path, ["write/report.json:1", "write/train.jsonl:1"],
                                         tiny_file)
  got, want = file_bytes(killed / "records"), file_bytes(straight / "records")
  assert sorted(want) == ["heldout.jsonl", "report.json", "train.jsonl"] and got == want
  assert json.loads(want["report.json"])["train"] >= 3
  assert_no_leftovers(killed)


def test_sft_survives_kills_before_a_checkpoint_during_one_and_during_export(tmp_path, tiny_file):
  import jax

  from pasta_jax.errors import ConfigError
  from pasta_jax.model.checkpoint import restore_checkpoint
  from pasta_jax.training.trainer import Trainer
  from tests import train_worker, training_data
  # before the first checkpoint; while the step-4 checkpoint is written; the export renamed, its marker not written
  killed, straight = killed_and_straight("sft", tmp_path, ["append/metrics.jsonl:2", "checkpoint:2", "mark/model:1"],
                                         tiny_file)
  run = Path("pasta_sft")
  assert_same_metrics(killed / run, straight / run)
  assert runfiles.is_complete(killed / run / "model")
  (config, params), (want_config, want_params) = (restore_checkpoint(f / run / "model") for f in (killed, straight))
  assert config == want_config
  flat = lambda tree: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}  # noqa: E731
  assert_same_arrays(flat(params), flat(want_params))
  assert_no_leftovers(killed / run)
  # resuming under another training config is refused, naming what changed
  model = kill_worker.tiny()
  changed = train_worker.CONFIG.replace(learning_rate=2e-3)
  with pytest.raises(ConfigError, match=r"learning_rate: 0\.001 then, 0\.002 now"):
    Trainer(changed, model, training_data.batches(model.tokenizer), killed / run, check_memory=False, progress=False)


def test_preference_sampling_scoring_and_bonbon_survive_kills(tmp_path, tiny_file):
  from safetensors.numpy import load_file

  from pasta_jax.model import lora
  # mid-chunk while sampling; inside a prompt's scores row (its pair already written by an older order) and inside
  # a pair (its scores row written); mid-training; the export renamed into place, its marker not yet written
  kills = ["append/samples.jsonl:2", "append/scores.jsonl:2", "append/pairs.jsonl:2", "append/metrics.jsonl:2",
           "mark/model:1"]
  killed, straight = killed_and_straight("bonbon", tmp_path, kills, tiny_file)
  pairs = Path("bonbon/round_1/pairs")
  got, want = file_bytes(killed / pairs), file_bytes(straight / pairs)
  assert sorted(want) == ["pairs.jsonl", "run.json", "samples.jsonl", "scores.jsonl", "verdicts.jsonl"]
  for name in want:
    assert got[name] == want[name], name
  assert len(want["pairs.jsonl"].splitlines()) == 4  # one pair per prompt, none twice
  train = Path("bonbon/round_1/train")
  assert_same_metrics(killed / train, straight / train)
  assert runfiles.is_complete(killed / train / "model")
  assert_same_arrays(*(load_file(str(f / train / "model" / lora.WEIGHTS_FILE)) for f in (killed, straight)))
  meta = [json.loads((f / train / "model" / lora.CONFIG_FILE).read_text()) for f in (killed, straight)]
  assert meta[0] == meta[1]
  assert_no_leftovers(killed / "bonbon")


@HEAVY  # the same resume machinery as the SFT and preference kills above
def test_medusa_distillation_and_heads_survive_kills(tmp_path, tiny_file):
  from safetensors.numpy import load_file

  from pasta_jax.model import medusa
  # a torn batch of answers; the hidden-state cache before its rename; the heads folder before its rename
  kills = ["append/distill.jsonl:2", "write/hidden_train.npz:1", "publish/heads:1"]
  killed, straight = killed_and_straight("medusa", tmp_path, kills, tiny_file)
  got, want = file_bytes(killed / "medusa"), file_bytes(straight / "medusa")
  assert sorted(got) == sorted(want)
  assert len(want["distill.jsonl"].splitlines()) == 6
  for name in want:
    if name.endswith(".npz"):
      with np.load(killed / "medusa" / name) as a, np.load(straight / "medusa" / name) as b:
        assert_same_arrays(dict(a), dict(b))
    elif name.endswith(".safetensors"):
      assert_same_arrays(load_file(str(killed / "medusa" / name)), load_file(str(straight / "medusa" / name)))
    else:
      assert got[name] == want[name], name
  assert runfiles.is_complete(killed / "medusa" / "heads") and f"heads/{medusa.WEIGHTS_FILE}" in got
  assert_no_leftovers(killed / "medusa")
