"""`evaluate` with fake methods: hand-computed speed aggregates, resume, judging, and the files it writes."""

from __future__ import annotations

import json
import math

import pytest

from pasta_jax.errors import PastaError
from pasta_jax.eval.methods import MethodOutput
from pasta_jax.eval.report import write_outputs
from pasta_jax.eval.runner import decode_order, evaluate
from pasta_jax.eval.speed import aggregate, prompt_speed
from pasta_jax.eval.store import PARTIAL_FILE, RunDirError, RunStore

IDENTITY = dict(prompts="fake", max_new_tokens=16)
RECORDS = [dict(id=str(i), instruction=f"question {i}", input="", output="") for i in range(3)]


def output(seconds: float, content_tokens: int, critical_path: float, text: str = "", threads: int = 1):
  return MethodOutput(text=text or "x" * content_tokens, annotated="", steps=20, seconds=seconds,
                      theoretical_speedup=content_tokens / critical_path, parallelism=content_tokens / critical_path,
                      content_tokens=content_tokens, critical_path=critical_path, finished=True, threads=threads)


class FakeMethod:
  """Returns a fixed output per prompt id; raises after `fail_after` calls (an interruption)."""

  def __init__(self, name, table, reference=None, fail_after=None):
    self.name, self.table, self.reference, self.fail_after = name, table, reference, fail_after
    self.calls = 0

  def check(self, records):
    pass

  def run(self, record):
    self.calls += 1
    if self.fail_after is not None and self.calls > self.fail_after:
      raise KeyboardInterrupt("simulated interruption")
    return self.table[record["id"]]


# Baseline: 2, 4, 8 s and 100, 50, 90 tokens. Method: 1, 4, 2 s; critical paths 50, 50, 30; 100, 100, 60 tokens.
BASELINE = {"0": output(2.0, 100, 100), "1": output(4.0, 50, 50), "2": output(8.0, 90, 90)}
METHOD = {"0": output(1.0, 100, 50, threads=3), "1": output(4.0, 100, 50, threads=2),
          "2": output(2.0, 60, 30, threads=4)}


def test_prompt_speed_is_reference_over_method():
  speed = prompt_speed(METHOD["0"], BASELINE["0"])
  assert (speed.realized_speedup, speed.theoretical_speedup, speed.parallelism) == (2.0, 2.0, 2.0)
  cut_off = output(1.0, 10, math.nan)  # a run cut off inside a block has no critical path
  assert math.isnan(prompt_speed(cut_off, BASELINE["0"]).theoretical_speedup)


def test_aggregates_by_hand():
  agg = aggregate([2.0, 1.0, 4.0])
  assert agg.geometric == pytest.approx(2.0)  # (2 * 1 * 4) ** (1/3)
  assert agg.arithmetic == pytest.approx(7 / 3)
  assert agg.n == 3
  assert aggregate([2.0, math.nan, 0.0]).n == 1  # undefined ratios are left out, and counted


def test_evaluate_aggregates_a_fake_table(tmp_path):
  results = evaluate(RECORDS, FakeMethod("base", BASELINE), [FakeMethod("fast", METHOD)], tmp_path,
                     identity=IDENTITY, progress=False)
  [base, fast] = results["methods"]
  assert (base["role"], fast["role"], fast["reference"]) == ("baseline", "method", "base")
  speed = fast["speed"]
  # realized: 2/1, 4/4, 8/2 = 2, 1, 4
  assert speed["realized_speedup"]["geometric"] == pytest.approx(2.0)
  assert speed["realized_speedup"]["arithmetic"] == pytest.approx(7 / 3)
  # theoretical: baseline tokens / method critical path = 100/50, 50/50, 90/30 = 2, 1, 3
  assert speed["theoretical_speedup"]["geometric"] == pytest.approx(6 ** (1 / 3))
  assert speed["theoretical_speedup"]["arithmetic"] == pytest.approx(2.0)
  # parallelism: method tokens / its critical path = 2, 2, 2
  assert speed["parallelism"] == dict(geometric=pytest.approx(2.0), arithmetic=pytest.approx(2.0), n=3)
  assert fast["quality"] is None and not results["judge"]["judged"]
  assert base["totals"]["seconds"] == 14.0 and base["totals"]["tokens_per_second"] == pytest.approx(240 / 14)
  assert results["prompts"][2]["runs"]["fast"]["realized_speedup"] == 4.0


def test_each_decode_runs_twice_and_keeps_the_second(tmp_path):
  class Counting(FakeMethod):
    def run(self, record):
      self.calls += 1
      return output(float(self.calls), 10, 10)

  base = Counting("base", None)
  results = evaluate(RECORDS[:1], base, [], tmp_path, identity=IDENTITY, progress=False)
  assert base.calls == 2
  assert results["prompts"][0]["runs"]["base"]["seconds"] == 2.0


def test_an_interrupted_run_resumes_only_the_missing_decodes(tmp_path):
  records = [dict(id=str(i), instruction="q", input="", output="") for i in range(4)]
  table = {r["id"]: output(1.0, 10, 10) for r in records}
  # Per prompt the baseline decodes, then the method; each decode runs twice. The method's 5th call is on
  # prompt 2: prompts 0 and 1 are done for both, prompt 2 for the baseline only.
  with pytest.raises(KeyboardInterrupt):
    evaluate(records, FakeMethod("base", table), [FakeMethod("m", table, fail_after=4)], tmp_path,
             identity=IDENTITY, progress=False)
  assert len((tmp_path / PARTIAL_FILE).read_text().splitlines()) == 5
  with open(tmp_path / PARTIAL_FILE, "a") as f:
    f.write('{"method": "m", "id": "3", "outp')  # a line half written when the run was killed
  base, method = FakeMethod("base", table), FakeMethod("m", table)
  results = evaluate(records, base, [method], tmp_path, identity=IDENTITY, progress=False)
  assert base.calls == 2 * 1 and method.calls == 2 * 2  # baseline: prompt 3; method: prompts 2 and 3
  assert results["methods"][1]["speed"]["realized_speedup"]["n"] == 4
  again_base, again_method = FakeMethod("base", table), FakeMethod("m", table)
  evaluate(records, again_base, [again_method], tmp_path, identity=IDENTITY, progress=False)
  assert again_base.calls == again_method.calls == 0


def test_a_run_folder_refuses_other_settings(tmp_path):
  RunStore(tmp_path).claim(IDENTITY)
  with pytest.raises(RunDirError, match="max_new_tokens: 16 then, 32 now"):
    RunStore(tmp_path).claim(dict(IDENTITY, max_new_tokens=32))


def test_a_method_with_its_own_reference_is_measured_against_it(tmp_path):
  twin = FakeMethod("twin", BASELINE)
  forced = FakeMethod("forced", METHOD, reference=twin)
  base = FakeMethod("base", {k: output(100.0, 1, 1) for k in BASELINE})
  assert [m.name for m in decode_order(base, [forced])] == ["base", "twin", "forced"]
  results = evaluate(RECORDS, base, [forced], tmp_path, identity=IDENTITY, progress=False)
  assert [m["role"] for m in results["methods"]] == ["baseline", "reference", "method"]
  assert results["methods"][2]["speed"]["realized_speedup"]["geometric"] == pytest.approx(2.0)
  with pytest.raises(PastaError, match="named twice"):
    decode_order(base, [forced, FakeMethod("forced", METHOD)])


class LengthJudge:
  """Prefers the longer answer, with some position bias (both orders cancel it)."""

  name = "length-judge"

  def __init__(self):
    self.calls = 0

  def compare(self, instruction, first, second):
    from pasta_jax.judges.base import Verdict

    self.calls += 1
    return Verdict(p_first=0.9 if len(first) > len(second) else 0.2 if len(first) < len(second) else 0.55)


def judged_run(tmp_path):
  records = [dict(id=str(i), instruction=f"q{i}", input="", output="") for i in range(6)]
  base = {r["id"]: output(2.0, 10, 10, text="b" * 10) for r in records}
  longer = [12, 8, 12, 12, 10, 12]  # wins 4, loses 1, ties one identical text
  method = {r["id"]: output(1.0, n, n / 2, text=("b" if n == 10 else "m") * n) for r, n in zip(records, longer)}
  judge = LengthJudge()
  results = evaluate(records, FakeMethod("base", base), [FakeMethod("m", method)], tmp_path, identity=IDENTITY,
                     judge=judge, progress=False)
  return results, judge


def test_judged_run_reports_win_rates_and_writes_its_files(tmp_path):
  results, judge = judged_run(tmp_path)
  assert judge.calls == 2 * 5  # both orders; the identical text is a tie without asking
  quality = results["methods"][1]["quality"]
  p_longer, p_shorter = 0.5 * (0.9 + 1 - 0.2), 0.5 * (0.2 + 1 - 0.9)
  assert quality["win_rate"] == pytest.approx(100 * (4 * p_longer + p_shorter + 0.5) / 6)
  assert math.isfinite(quality["lc_win_rate"]) and quality["n"] == 6
  results["settings"] = dict(IDENTITY, lanes=4)
  paths = write_outputs(results, tmp_path)
  assert [p.name for p in paths] == ["results.json", "report.md", "pareto.png"]
  saved = json.loads((tmp_path / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
  assert saved["methods"][1]["quality"]["win_rate"] == pytest.approx(quality["win_rate"])
  report = (tmp_path / "report.md").read_text()
  assert "| `m` | `base` | 6 | 2.00 | 2.00 |" in report and "LC win rate" in report
  assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unjudged_report_says_so(tmp_path):
  results = evaluate(RECORDS, FakeMethod("base", BASELINE), [FakeMethod("fast", METHOD)], tmp_path,
                     identity=IDENTITY, judge_note="No judge configured.", progress=False)
  write_outputs(results, tmp_path)
  report = (tmp_path / "report.md").read_text()
  assert "**Quality was not judged**" in report and "No judge configured." in report
  assert "| `fast` | `base` | 3 | 2.00 | 2.33 | 1.82 | 2.00 | 2.00 | 2.00 | not judged | not judged |" in report
  assert (tmp_path / "pareto.png").stat().st_size > 10_000
