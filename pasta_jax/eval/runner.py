"""`evaluate`: decode every prompt with every method (timed, resumable), judge, and gather the results.

Order of work: for each prompt, each method in turn (baseline first, then each method's own reference,
then the method), so a method and its reference run back to back, under the same machine load.
Each decode runs twice and the second run is kept (the first compiles and warms up). Judging comes
after all decoding, so a judge never competes with a timed run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from tqdm import tqdm

from pasta_jax.data.encode import record_prompt
from pasta_jax.errors import PastaError
from pasta_jax.eval.methods import Method, MethodOutput
from pasta_jax.eval.speed import aggregate_speeds, prompt_speed
from pasta_jax.eval.store import RunStore
from pasta_jax.eval.winrate import win_rates

Outputs = dict[tuple[str, str], MethodOutput]  # (method label, prompt id) -> output


def evaluate(records: Sequence[Mapping[str, str]], baseline: Method, methods: Sequence[Method], out_dir,
             *, identity: dict, judge=None, judge_note: str = "", progress: bool = True) -> dict:
  """Runs (or resumes) an evaluation into `out_dir` and returns the results (see `gather`).

  identity: what makes two runs comparable (prompt source, decode settings, model); checked on resume.
  judge: a `judges.base.Judge`, or None to measure speed only (judge_note then says why).
  """
  if not records:
    raise PastaError("no prompts to evaluate")
  order = decode_order(baseline, methods)
  for method in [*methods, *order]:  # the methods named first, so an error names what the user asked for
    method.check(records)
  store = RunStore(out_dir)
  store.claim(identity)
  outputs = decode_all(records, order, store, progress)
  verdicts = judge_all(judge, records, methods, baseline, outputs, progress) if judge is not None else {}
  return gather(records, baseline, methods, outputs, verdicts, judge, judge_note, identity)


def decode_order(baseline: Method, methods: Sequence[Method]) -> list[Method]:
  """The baseline, then each method preceded by its own reference; each label once."""
  order: dict[str, Method] = {baseline.name: baseline}
  for method in methods:
    if method.reference is not None:
      order.setdefault(method.reference.name, method.reference)
    if method.name in order:
      raise PastaError(f"method {method.name!r} is named twice (or is also the baseline or a reference)")
    order[method.name] = method
  return list(order.values())


def decode_all(records, order: Sequence[Method], store: RunStore, progress: bool) -> Outputs:
  outputs = store.finished()
  todo = [(record, method) for record in records for method in order if (method.name, record["id"]) not in outputs]
  skipped = len(records) * len(order) - len(todo)
  bar = tqdm(todo, desc="decoding", unit="run", disable=not progress)
  if skipped:
    bar.write(f"resuming: {skipped} decodes already in {store.partial}")
  for record, method in bar:
    bar.set_postfix_str(f"{method.name} / {record['id']}", refresh=False)
    output = second_of_two(method, record)
    store.append(method.name, record["id"], output)
    outputs[(method.name, record["id"])] = output
  return outputs


def second_of_two(method: Method, record: Mapping[str, str]) -> MethodOutput:
  """The paper's timing: decode twice, keep the second (compile and warm-up excluded)."""
  method.run(record)
  return method.run(record)


def reference_of(method: Method, baseline: Method) -> Method:
  return method.reference if method.reference is not None else baseline


# --- quality -----------------------------------------------------------------------------------------
def judge_all(judge, records, methods: Sequence[Method], baseline: Method, outputs: Outputs,
              progress: bool) -> dict[tuple[str, str], float]:
  """P(method beats its reference) per (method, prompt), both orders. Identical texts are a tie (0.5)
  without asking the judge: a forced replay and its twin always are."""
  from pasta_jax.judges.base import judge_both_orders

  verdicts = {}
  pairs = [(m, r) for m in methods for r in records]
  for method, record in tqdm(pairs, desc="judging", unit="pair", disable=not progress):
    ours = outputs[(method.name, record["id"])].text
    theirs = outputs[(reference_of(method, baseline).name, record["id"])].text
    key = (method.name, record["id"])
    verdicts[key] = 0.5 if ours == theirs else judge_both_orders(judge, record_prompt(record), ours, theirs)
  return verdicts


# --- results -----------------------------------------------------------------------------------------
def gather(records, baseline: Method, methods: Sequence[Method], outputs: Outputs, verdicts, judge,
           judge_note: str, identity: dict) -> dict:
  """The results: per method its aggregates, per prompt every run's output and metrics."""
  order = decode_order(baseline, methods)
  roles = {m.name: "reference" for m in order}
  roles[baseline.name] = "baseline"
  roles.update({m.name: "method" for m in methods})
  summaries = [method_summary(m, roles[m.name], records, baseline, outputs, verdicts, judge is not None)
               for m in order]
  prompts = [prompt_entry(r, order, methods, baseline, outputs, verdicts) for r in records]
  return dict(settings=dict(identity), n_prompts=len(records), baseline=baseline.name,
              judge=dict(name=getattr(judge, "name", None), judged=judge is not None, note=judge_note),
              methods=summaries, prompts=prompts)


def method_summary(method: Method, role: str, records, baseline: Method, outputs: Outputs, verdicts,
                   judged: bool) -> dict:
  runs = [outputs[(method.name, r["id"])] for r in records]
  seconds = sum(o.seconds for o in runs)
  summary = dict(name=method.name, role=role, reference=None, totals=dict(
      n=len(runs), seconds=seconds, content_tokens=sum(o.content_tokens for o in runs),
      tokens_per_second=sum(o.content_tokens for o in runs) / seconds if seconds > 0 else math.nan,
      finished=sum(o.finished for o in runs), with_forks=sum(o.threads > 1 for o in runs),
      steps=sum(o.steps for o in runs), head_fallbacks=sum(o.head_fallbacks for o in runs)))
  if role != "method":
    return summary
  reference = reference_of(method, baseline)
  speeds = [prompt_speed(outputs[(method.name, r["id"])], outputs[(reference.name, r["id"])]) for r in records]
  summary.update(reference=reference.name,
                 speed={k: dataclasses.asdict(v) for k, v in aggregate_speeds(speeds).items()},
                 quality=quality(method, reference, records, outputs, verdicts) if judged else None)
  return summary


def quality(method: Method, reference: Method, records, outputs: Outputs, verdicts) -> dict:
  p = [verdicts[(method.name, r["id"])] for r in records]
  ours = [len(outputs[(method.name, r["id"])].text) for r in records]
  theirs = [len(outputs[(reference.name, r["id"])].text) for r in records]
  return dataclasses.asdict(win_rates(p, ours, theirs))


def prompt_entry(record, order: Sequence[Method], methods: Sequence[Method], baseline: Method, outputs: Outputs,
                 verdicts) -> dict:
  runs = {m.name: dataclasses.asdict(outputs[(m.name, record["id"])]) for m in order}
  for method in methods:
    reference = reference_of(method, baseline)
    speed = prompt_speed(outputs[(method.name, record["id"])], outputs[(reference.name, record["id"])])
    runs[method.name].update(dataclasses.asdict(speed), p_win=verdicts.get((method.name, record["id"])))
  return dict(id=record["id"], instruction=record_prompt(record), runs=runs)
