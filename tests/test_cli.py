"""Bad input to `pasta generate` gets one line naming the problem and a nonzero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "pasta_jax.cli", *args], capture_output=True, text=True,
                        timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
  assert result.returncode != 0
  lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("pasta: error:"), lines[0]
  assert "Traceback" not in result.stderr
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])


def test_missing_model_path(tmp_path):
  missing = tmp_path / "nope.gguf"
  assert_one_line_error(run_cli("generate", "hi", "--model", str(missing)), str(missing))


def test_corrupt_gguf(tmp_path):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"GGUF" + b"\x00garbage" * 10)
  assert_one_line_error(run_cli("generate", "hi", "--model", str(bad)), "bad.gguf")


def test_folder_without_weights(tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"}')
  assert_one_line_error(run_cli("generate", "hi", "--model", str(tmp_path)))


@pytest.mark.parametrize("args,needle", [
    (["generate", "   "], "empty prompt"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["eval", "--out", "unused", "--repetition-penalty", "-1"], "--repetition-penalty"),
])
def test_bad_arguments(args, needle):
  assert_one_line_error(run_cli(*args), needle)
