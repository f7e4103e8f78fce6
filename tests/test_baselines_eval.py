"""`pasta eval` runs the baselines (apar, apar-forced, sot, sot-router) beside pasta on one report."""

from __future__ import annotations

import json

from pasta_jax.commands.eval import run_eval
from pasta_jax.data.apar_format import strip_apar
from pasta_jax.eval import methods as M
from tests.test_eval_command import parse, write_prompts
from tests.tiny import tiny_model

LIST = ("Tips:\n1. Sleep well: go to bed on time.\n2. Eat well: light meals at night.\n"
        "3. Move daily: walk for half an hour.\n")
PROSE = ("Hello there. It is nice to meet you, and I hope that your day is going well so far. "
         "Tell me what you would like to talk about today, and we can begin.")
# Both chat prompts pad to one bucket (64 characters) and every run to one pool (512 slots: the budget
# of 160 tokens is longer than either forced answer), so each method compiles one loop, not two.
RECORDS = [dict(id="tips", instruction="Tips?", output=LIST),
           dict(id="prose", instruction="Hi.", output=PROSE)]


def test_baselines_on_one_report(tmp_path, monkeypatch):
  model = tiny_model()
  monkeypatch.setattr(M, "cached_model", lambda path: model)
  monkeypatch.delenv("PASTA_JUDGE_BASE_URL", raising=False)
  out = tmp_path / "run"
  methods = ("pasta-forced", "apar-forced", "apar", "sot", "sot-router")
  args = parse("--prompts", write_prompts(tmp_path, RECORDS), "--methods", *methods,
               "--out", str(out), "--max-new-tokens", "160", "--lanes", "2", "--no-progress")
  assert run_eval(args) == 0
  results = json.loads((out / "results.json").read_text())
  names = [m["name"] for m in results["methods"]]
  assert {"pasta-forced", "apar-forced", "apar", "sot", "sot-router", "sequential-forced"} <= set(names)
  runs = results["prompts"][0]["runs"]
  assert runs["apar-forced"]["text"] == runs["sequential-forced"]["text"] == LIST
  assert runs["apar-forced"]["threads"] == 4 and runs["apar-forced"]["annotated"].count("<fork/>") == 3
  assert strip_apar(runs["apar-forced"]["annotated"]) == LIST
  assert "rule router" in runs["sot-router"]["note"]  # the char tokenizer has no single yes/no token
  report = (out / "report.md").read_text()
  assert "`apar-forced`" in report and "`sot`" in report
