"""`python -m infer.generate`: a file of prompts answered in batches, resumed after a kill, refused under other
settings; its answers are `generate`'s."""

from __future__ import annotations

import json

import pytest

from infer import generate as infer_generate
from pasta_jax.methods import generate
from tests.tiny import tiny_model

MODEL = tiny_model()


@pytest.fixture
def prompts(tmp_path):
  path = tmp_path / "prompts.jsonl"
  rows = [{"id": i, "instruction": text, "output": ""} for i, text in enumerate(["abc", "hello there", "xyz", "q"])]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
  monkeypatch.setattr("pasta_jax.model.load.load_model", lambda path=None, *a, **k: MODEL)


def run(prompts, out, *extra) -> int:
  return infer_generate.main(["--prompts", str(prompts), "--out", str(out), "--method", "sequential",
                              "--max-new-tokens", "6", "--batch-size", "2", *extra])


def rows(out) -> list[dict]:
  return [json.loads(line) for line in out.read_text().splitlines()]


def test_answers_are_generates_and_a_rerun_resumes(prompts, tmp_path):
  out = tmp_path / "answers.jsonl"
  assert run(prompts, out, "--limit", "3") == 0
  first = rows(out)
  expected = generate(MODEL, ["abc", "hello there", "xyz"], "sequential", max_new_tokens=6)
  assert [r["id"] for r in first] == ["0", "1", "2"]
  assert [r["text"] for r in first] == [e.text for e in expected]
  lines = out.read_text().splitlines()
  out.write_text(lines[0] + "\n" + lines[1][:10])  # killed while writing the second answer
  assert run(prompts, out, "--limit", "3") == 0
  again = rows(out)
  assert [r["id"] for r in again] == ["0", "1", "2"] and again == first


def test_other_settings_are_refused(prompts, tmp_path, capsys):
  out = tmp_path / "answers.jsonl"
  assert run(prompts, out, "--limit", "1") == 0
  assert run(prompts, out, "--limit", "1", "--temperature", "0.5") == 2
  assert "temperature: 0.0 then, 0.5 now" in capsys.readouterr().err
  assert len(rows(out)) == 1
