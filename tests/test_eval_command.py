"""`pasta eval` through its command function: an end-to-end run on the tiny model, and one-line user errors."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pasta_jax.commands.eval import build_eval_parser, run_eval
from pasta_jax.errors import PastaError
from pasta_jax.eval import methods as M
from tests.tiny import tiny_model

RECORDS = [
  dict(id="colors", instruction="Name two colors.", output="Colors:\n- red\n- blue\n"),
  dict(id="fruits", instruction="Name two fruits.", output="Fruits:\n1. apple\n2. pear\n"),  # cut to 24 tokens
]


def parse(*argv: str) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="pasta")
  build_eval_parser(parser.add_subparsers(dest="command", required=True))
  return parser.parse_args(["eval", *argv])


def write_prompts(tmp_path, records=RECORDS):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


@pytest.fixture
def no_model_loads(monkeypatch):
  """User errors must be caught before any model is loaded."""
  monkeypatch.setattr(M, "cached_model", lambda path: pytest.fail("loaded a model before checking the input"))


def test_end_to_end_on_the_tiny_model(tmp_path, monkeypatch, capsys):
  model = tiny_model()
  monkeypatch.setattr(M, "cached_model", lambda path: model)
  monkeypatch.delenv("PASTA_JUDGE_BASE_URL", raising=False)
  out = tmp_path / "run"
  args = parse("--prompts", write_prompts(tmp_path), "--methods", "pasta-forced", "--out", str(out),
               "--max-new-tokens", "24", "--lanes", "4", "--no-progress")
  assert run_eval(args) == 0
  printed = capsys.readouterr().out
  assert "| `pasta-forced` | `sequential-forced` | 2 |" in printed and "quality not judged" in printed
  results = json.loads((out / "results.json").read_text())
  assert [(m["name"], m["role"]) for m in results["methods"]] == [
    ("sequential", "baseline"), ("sequential-forced", "reference"), ("pasta-forced", "method")]
  assert results["settings"]["prompts"] == "prompts" and results["settings"]["max_new_tokens"] == 24
  colors = results["prompts"][0]["runs"]
  assert colors["pasta-forced"]["text"] == colors["sequential-forced"]["text"] == RECORDS[0]["output"]
  assert colors["pasta-forced"]["threads"] == 3 and colors["sequential-forced"]["threads"] == 1  # two list items
  assert "<promise" in colors["pasta-forced"]["annotated"]
  assert results["prompts"][1]["runs"]["sequential-forced"]["content_tokens"] == 24  # the answer cut to the budget
  pasta = results["methods"][2]
  assert pasta["speed"]["realized_speedup"]["n"] == 2 and math.isfinite(pasta["speed"]["realized_speedup"]["geometric"])
  expected = [r["runs"]["sequential-forced"]["content_tokens"] / r["runs"]["pasta-forced"]["critical_path"]
              for r in results["prompts"]]
  assert pasta["speed"]["theoretical_speedup"]["geometric"] == pytest.approx(math.prod(expected) ** 0.5)
  assert not results["judge"]["judged"] and "PASTA_JUDGE_BASE_URL" in results["judge"]["note"]
  assert (out / "report.md").exists() and (out / "pareto.png").exists()
  # A second run finds every decode done: nothing is decoded again.
  monkeypatch.setattr(M.InterpreterMethod, "run", lambda *a: pytest.fail("decoded again on resume"))
  assert run_eval(args) == 0


def test_unknown_methods_list_the_known_ones(tmp_path, no_model_loads):
  with pytest.raises(PastaError, match="unknown method 'bogus'; known methods: pasta, sequential, pasta-v0, apar"):
    run_eval(parse("--methods", "bogus", "--out", str(tmp_path)))
  with pytest.raises(PastaError, match=r"known methods: .*pasta-forced, .*apar-forced, sot, sot-router"):
    run_eval(parse("--methods", "bogus", "--out", str(tmp_path)))
  with pytest.raises(PastaError, match="empty model path"):
    run_eval(parse("--methods", "pasta:", "--out", str(tmp_path)))


def test_missing_prompts_file(tmp_path, no_model_loads):
  with pytest.raises(PastaError, match="no such data file: .*nope.jsonl"):
    run_eval(parse("--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)))


def test_limit_must_be_positive(tmp_path, no_model_loads):
  with pytest.raises(PastaError, match="--limit must be at least 1, got 0"):
    run_eval(parse("--limit", "0", "--out", str(tmp_path)))


def test_forced_methods_need_reference_answers(tmp_path, monkeypatch):
  monkeypatch.setattr(M, "cached_model", lambda path: tiny_model())
  prompts = write_prompts(tmp_path, [dict(question_id=81, turns=["Write a poem."])])  # MT-Bench: no reference
  with pytest.raises(PastaError, match="pasta-forced replays reference answers, but 1 prompt"):
    run_eval(parse("--prompts", prompts, "--judge", "none", "--out", str(tmp_path / "run")))


SCOPED_RECORDS = [dict(id="fuels", instruction="Name two fuels.",
                       output="Fuels:\n- **Coal**: a rock that burns hot\n- **Wood**: grows back in forests\n")]


def test_scoped_methods_on_the_tiny_model(tmp_path, monkeypatch):
  """pasta-v0-forced replays the earlier paper's scoped annotation against its tag-free twin, through the same
  scoped interpreter; pasta-v0 decodes freely in the scoped mode. Both land on the one report."""
  model = tiny_model()
  monkeypatch.setattr(M, "cached_model", lambda path: model)
  monkeypatch.delenv("PASTA_JUDGE_BASE_URL", raising=False)
  out = tmp_path / "run"
  args = parse("--prompts", write_prompts(tmp_path, SCOPED_RECORDS), "--methods", "pasta-v0-forced", "pasta-v0",
               "--out", str(out), "--max-new-tokens", "96", "--lanes", "4", "--no-progress")
  assert run_eval(args) == 0
  results = json.loads((out / "results.json").read_text())
  assert [(m["name"], m["role"]) for m in results["methods"]] == [
    ("sequential", "baseline"), ("pasta-v0-tag-free", "reference"), ("pasta-v0-forced", "method"),
    ("pasta-v0", "method")]
  runs = results["prompts"][0]["runs"]
  assert runs["pasta-v0-forced"]["text"] == runs["pasta-v0-tag-free"]["text"] == SCOPED_RECORDS[0]["output"]
  assert "<scope>" in runs["pasta-v0-forced"]["annotated"] and runs["pasta-v0-forced"]["threads"] == 3
  assert runs["pasta-v0-tag-free"]["threads"] == 1
  assert runs["pasta-v0-forced"]["critical_path"] < runs["pasta-v0-tag-free"]["critical_path"]
  assert "pasta-v0-forced" in (out / "report.md").read_text()
