"""train.self_answers: a model's own answers as a training pool; cut answers counted, not kept; resumes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pasta_jax import methods
from pasta_jax.model import load
from train import self_answers


@pytest.fixture
def answering(monkeypatch):
  """A fake model: the answer to prompt P is "answer to P", cut when P contains "long"; records its calls."""
  asked = []

  def fake_generate(model, prompts, method, *, max_new_tokens, sampling):
    assert method == "sequential" and sampling.repetition_penalty == 1.1
    asked.extend(prompts)
    return [SimpleNamespace(text=f"answer to {p} ", truncated="long" in p) for p in prompts]

  monkeypatch.setattr(methods, "generate", fake_generate)
  monkeypatch.setattr(load, "load_model", lambda name: SimpleNamespace(name=name))
  monkeypatch.setattr(load, "generation_defaults", lambda model: {"repetition_penalty": 1.1})
  return asked


def _records(tmp_path, instructions):
  path = tmp_path / "records.jsonl"
  rows = [{"id": f"r{i}", "instruction": text, "output": f"ref {i}", "annotated": "tagged"}
          for i, text in enumerate(instructions)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_kept_row_is_the_models_answer_beside_the_reference_and_cut_answers_are_counted(tmp_path, answering):
  records, out = _records(tmp_path, ["a", "a long one", "b"]), tmp_path / "answers.jsonl"
  assert self_answers.main(["--records", records, "--out", str(out), "--batch-size", "2"]) == 0
  rows = _rows(out)
  assert [(r["id"], r["output"], r["reference"]) for r in rows] == [("r0", "answer to a", "ref 0"),
                                                                    ("r2", "answer to b", "ref 2")]
  assert all("annotated" not in r and "baseline-sft" in r["answer_source"] for r in rows)
  report = json.loads((tmp_path / "answers.jsonl.report.json").read_text())
  assert report["kept"] == 2 and report["cut"] == ["r1"]


def test_a_rerun_answers_only_what_is_missing_and_again_a_row_a_kill_tore(tmp_path, answering):
  records, out = _records(tmp_path, ["a", "a long one", "b", "c"]), tmp_path / "answers.jsonl"
  self_answers.main(["--records", records, "--out", str(out), "--batch-size", "2", "--limit", "2"])
  assert answering == ["a", "a long one"]
  answering.clear()
  self_answers.main(["--records", records, "--out", str(out), "--batch-size", "2", "--limit", "3"])
  assert answering == ["b"]  # neither the kept nor the cut answer is asked again
  with out.open("a") as file:  # what a kill in the middle of an append leaves
    file.write('{"id": "r3", "outp')
  answering.clear()
  self_answers.main(["--records", records, "--out", str(out), "--batch-size", "2"])
  assert answering == ["c"]
  assert [r["id"] for r in _rows(out)] == ["r0", "r2", "r3"]
  assert json.loads((tmp_path / "answers.jsonl.report.json").read_text())["kept"] == 3
