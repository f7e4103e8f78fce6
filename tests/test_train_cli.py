"""The training entry points refuse bad settings with a message that names them, before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pasta_jax.errors import PastaError
from train import bonbon


def test_bonbon_rejects_zero_rounds(tmp_path):
  with pytest.raises(PastaError, match="--rounds must be at least 1"):
    bonbon.main(["--data", "lima", "--out", str(tmp_path), "--rounds", "0"])


def test_bonbon_quality_without_judge_is_refused():
  judge_for = bonbon.judge_factory("none", quality_weight=1.0)
  with pytest.raises(PastaError, match="needs a judge"):
    judge_for("unused")
  assert bonbon.judge_factory("none", quality_weight=0.0)("unused") is None


def test_bonbon_defaults_follow_the_paper():
  args = bonbon.parse_args(["--data", "lima", "--out", "x"])
  pref = bonbon.preference_config(args)
  assert (pref.num_samples, pref.temperature) == (10, 1.0)


def test_bonbon_cli_error_is_one_line(tmp_path):
  run = subprocess.run([sys.executable, "-m", "train.bonbon", "--data", "lima", "--out", str(tmp_path),
                        "--model", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
  assert run.returncode == 2 and "Traceback" not in run.stderr
  assert "nope" in run.stderr and "does not exist" in run.stderr


def test_baseline_and_pasta_sft_train_on_the_same_records(tmp_path):
  import json

  from tests.tiny import CharTokenizer
  from train import sft
  data = tmp_path / "pool.jsonl"
  rows = [{"id": str(i), "instruction": f"q{i}", "input": "",
           "output": "Items:\n- one thing\n- another thing\n" if i % 2 else "Just prose."} for i in range(6)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  kept = {}
  for objective in ("sft", "baseline_sft"):
    args = sft.parse_args(["--data", str(data), "--data-dir", str(tmp_path / "tfds"), "--out", str(tmp_path / "o"),
                           "--objective", objective, "--only-annotated"])
    train, _ = sft.training_records(args, CharTokenizer())
    kept[objective] = sorted(r["id"] for r in train)
  assert kept["sft"] == kept["baseline_sft"] and len(kept["sft"]) >= 2
