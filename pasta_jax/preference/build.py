"""The resumable preference pipeline: sample -> baseline -> judge -> pairs.

  <out>/run.json        the settings (a rerun with other settings into the same folder is refused)
  <out>/samples.jsonl   per prompt: its N samples (exact ids) and the baseline's greedy answer
  <out>/verdicts.jsonl  every judgement (`CachedJudge`): a resumed run never judges a pair twice
  <out>/scores.jsonl    per prompt: every sample's speedup, quality and score, and the pair chosen
                        (or why there is none)
  <out>/pairs.jsonl     the pairs: prompt, chosen and rejected answers with their scores; the
                        reference log-probs are added by `reference.add_reference_logprobs`
Every file is appended one prompt at a time, so a killed run resumes where it stopped, and a torn last row
is cut before the next append (`runfiles`). What a kill can leave, and what the resume does:
  samples   prompts are sampled in fixed chunks of the record list (each with its own seed); a chunk cut off
            part-way is sampled again whole and only its missing rows appended, so every row is what an
            uninterrupted run writes
  scores    a prompt is done once its scores row exists; that row holds the decision (which samples are
            chosen and rejected, with their figures), so its pairs row is a pure function of it and of the
            samples row. SCORES is written first: a kill before the PAIRS row loses nothing, since the resume
            writes every missing pair of a scored prompt from those two rows (`_pair_row`), and a prompt
            already in PAIRS never gets a second row, so nothing is duplicated either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pasta_jax.data.encode import record_prompt
from pasta_jax.errors import PastaError
from pasta_jax.judges.base import Judge
from pasta_jax.lang.metrics import block_texts
from pasta_jax.model import runfiles
from pasta_jax.preference import scoring
from pasta_jax.preference.config import PreferenceConfig
from pasta_jax.preference.sampling import Sample, greedy_answers, sample_answers

SAMPLES, SCORES, PAIRS, VERDICTS = "samples.jsonl", "scores.jsonl", "pairs.jsonl", "verdicts.jsonl"
NO_VALID_PAIR, ALL_TIED = "fewer than 2 well-formed samples", "every sample scored the same"


@dataclasses.dataclass(frozen=True)
class BuildSummary:
  prompts: int
  pairs: int
  dropped: dict[str, int]  # reason -> prompts
  well_formed_share: float  # of all samples
  chosen_speedup: float  # means over pairs
  rejected_speedup: float
  chosen_quality: float
  rejected_quality: float

  def line(self) -> str:
    dropped = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items()) or "none"
    return (f"{self.pairs} pairs from {self.prompts} prompts (dropped: {dropped}); well-formed samples "
            f"{self.well_formed_share:.0%}; speedup chosen {self.chosen_speedup:.2f} vs rejected "
            f"{self.rejected_speedup:.2f}; quality chosen {self.chosen_quality:.2f} vs rejected "
            f"{self.rejected_quality:.2f}")


@dataclasses.dataclass(frozen=True)
class Samplers:
  """How answers are drawn: the batched interpreter by default; tests substitute forced replays."""

  sample: Callable = sample_answers  # (model, prompts, cfg, *, seed) -> [P][N] Samples
  greedy: Callable = greedy_answers  # (model, prompts, cfg) -> [P] Samples


def build_pairs(policy, baseline, records: Sequence[Mapping[str, Any]], judge: Judge | None, cfg: PreferenceConfig,
                out_dir: str | Path, *, identity: dict | None = None, samplers: Samplers = Samplers(),
                progress: bool = True) -> BuildSummary:
  """Samples the policy, scores against the baseline (and each record's `output`), writes the pairs.

  judge may be None when quality_weight is 0 (speed alone decides), or quality_measure is "rouge" (the
  reference answer decides) or "logp" (the baseline model's log-likelihood decides); the judge is then not asked.
  """
  if judge is None and cfg.quality_weight != 0 and cfg.quality_measure == "judge":
    raise PastaError(f"scoring with quality_weight={cfg.quality_weight} needs a judge: set PASTA_JUDGE_BASE_URL "
                     "or pass --judge local:MODEL (or --quality-measure rouge, or --quality-weight 0 to rank by "
                     "speedup alone)")
  records = list(records)
  if cfg.quality_weight != 0 and cfg.quality_measure == "rouge":
    missing = [str(r["id"]) for r in records if not r.get("output")]
    if missing:
      raise PastaError(f"--quality-measure rouge scores against each record's reference answer ('output'); "
                       f"{len(missing)} of {len(records)} records have none (ids {', '.join(missing[:5])}...)")
  out = runfiles.claim(out_dir, _identity(cfg, identity))
  _sample_pending(policy, baseline, records, cfg, out, samplers, progress)
  sampled = {row["id"]: row for row in runfiles.read_rows(out / SAMPLES)}
  scores = {row["id"]: row for row in runfiles.read_rows(out / SCORES)}
  paired = {row["id"] for row in runfiles.read_rows(out / PAIRS)}
  for key, result in scores.items():  # scored before a kill, its pair not yet written
    if result.get("chosen") is not None and key not in paired and key in sampled:
      runfiles.append_row(out / PAIRS, _pair_row(sampled[key], result))
      paired.add(key)
  pending = [sampled[str(r["id"])] for r in records if str(r["id"]) not in scores]
  likelihood = _likelihood(baseline, cfg.chat) if cfg.quality_measure == "logp" and cfg.quality_weight != 0 else None
  for row in tqdm(pending, desc="judging", unit="prompt", disable=not progress):
    _score_prompt(row, judge, cfg, out, likelihood, paired)
  return summarize(out, {str(r["id"]) for r in records})


def _identity(cfg: PreferenceConfig, extra: dict | None) -> dict:
  fields = {**dataclasses.asdict(cfg), "quality_weight": str(cfg.quality_weight), **(extra or {})}
  if cfg.quality_measure == "judge":
    del fields["quality_measure"]  # run folders written before the field existed stay resumable
  return fields


def _likelihood(model, chat: bool) -> Callable[[str, str], float]:
  """(prompt, clean answer) -> mean log p per token under `model`; cached, so each baseline answer is scored once."""
  from pasta_jax.eval.quality import answer_logprob
  return functools.lru_cache(maxsize=1024)(lambda prompt, text: answer_logprob(model, prompt, text, chat=chat)[0])


def _sample_pending(policy, baseline, records, cfg: PreferenceConfig, out: Path, samplers: Samplers,
                    progress: bool) -> None:
  done = {row["id"] for row in runfiles.read_rows(out / SAMPLES)}
  chunk = cfg.prompts_per_run
  # Fixed chunks of the record list, so a chunk's prompts are sampled together, under the seed of its first
  # index, however often the run was cut off: a chunk with a missing row is sampled again whole.
  parts = [list(enumerate(records))[start:start + chunk] for start in range(0, len(records), chunk)]
  parts = [part for part in parts if any(str(r["id"]) not in done for _, r in part)]
  bar = tqdm(total=sum(len(part) for part in parts), desc="sampling", unit="prompt", disable=not progress)
  for part in parts:
    prompts = [record_prompt(r) for _, r in part]
    seed = cfg.seed * 1_000_003 + part[0][0]  # a pure function of the first prompt's index
    samples = samplers.sample(policy, prompts, cfg, seed=seed)
    base = samplers.greedy(baseline, prompts, cfg)
    for (_, record), prompt, answers, base_answer in zip(part, prompts, samples, base):
      if str(record["id"]) in done:
        continue
      runfiles.append_row(out / SAMPLES, {
          "id": str(record["id"]), "prompt": prompt, "reference": record.get("output") or None,
          "baseline": base_answer.to_json(), "samples": [a.to_json() for a in answers]})
    bar.update(len(part))
  bar.close()


def speed(sample: Sample, baseline: Sample, measure: str) -> float:
  """The speed term of the score (PreferenceConfig.speed_measure)."""
  steps = max(sample.critical_path, 1)
  return (baseline.content_tokens if measure == "speedup" else sample.content_tokens) / steps


def _quality(sample: Sample, baseline: Sample, row: dict, judge: Judge | None, cfg: PreferenceConfig,
             opponents: dict[str, str], likelihood: Callable[[str, str], float] | None) -> tuple[float, list]:
  """(quality, the judgements behind it): 0 when nothing measures quality (speed alone decides)."""
  if cfg.quality_measure == "logp":
    if likelihood is None:
      return 0.0, []
    prompt = row["prompt"]
    return scoring.likelihood_quality(likelihood(prompt, sample.text), likelihood(prompt, baseline.text)), []
  if cfg.quality_measure == "rouge":
    reference = row.get("reference")
    return (scoring.rouge_quality(sample.text, baseline.text, reference) if reference else 0.0), []
  if judge is None:
    return 0.0, []
  judgements = scoring.judge_against(judge, row["prompt"], sample.text, opponents)
  return scoring.quality(judgements, cfg.loss_floor), judgements


def _score_prompt(row: dict, judge: Judge | None, cfg: PreferenceConfig, out: Path,
                  likelihood: Callable[[str, str], float] | None = None, paired: set[str] | None = None) -> None:
  baseline = Sample.from_json(row["baseline"])
  samples = [Sample.from_json(s) for s in row["samples"]]
  opponents = {"baseline": baseline.text}
  if row.get("reference"):
    opponents["reference"] = row["reference"]
  candidates = []
  for index, sample in enumerate(samples):
    if not sample.well_formed:
      candidates.append({"index": index, "well_formed": False})
      continue
    quality, judgements = _quality(sample, baseline, row, judge, cfg, opponents, likelihood)
    speedup = speed(sample, baseline, cfg.speed_measure)
    duplicates = scoring.duplicate_share(_blocks(sample.annotated))
    key = scoring.score(speedup, quality, cfg.quality_weight, cfg.duplicate_penalty * duplicates)
    candidates.append({"index": index, "well_formed": True, "speedup": speedup, "quality": quality,
                       "duplicates": duplicates,
                       "score": key[0], "key": list(key), "wins_losses": scoring.wins_and_losses(judgements),
                       "judged": bool(judgements)})
  valid = [c for c in candidates if c["well_formed"]]
  picked = scoring.best_and_worst([tuple(c["key"]) for c in valid])
  reason = NO_VALID_PAIR if len(valid) < 2 else ALL_TIED if picked is None else None
  result = {"id": row["id"], "candidates": candidates, "reason": reason}
  if picked is not None:
    chosen, rejected = (valid[k] for k in picked)
    result.update(chosen=chosen["index"], rejected=rejected["index"])
  runfiles.append_row(out / SCORES, result)  # first: the prompt is done, and its pair follows from this row
  if picked is not None and row["id"] not in (paired or ()):
    runfiles.append_row(out / PAIRS, _pair_row(row, result))


def _pair_row(sampled: dict, result: dict) -> dict:
  """The PAIRS row of a prompt: its samples row and its scores row (chosen and rejected indices) decide it."""
  samples, candidates = sampled["samples"], {c["index"]: c for c in result["candidates"]}
  chosen, rejected = result["chosen"], result["rejected"]
  return {"id": sampled["id"], "prompt": sampled["prompt"],
          "chosen": {**Sample.from_json(samples[chosen]).to_json(), **_metrics(candidates[chosen])},
          "rejected": {**Sample.from_json(samples[rejected]).to_json(), **_metrics(candidates[rejected])},
          "baseline_tokens": Sample.from_json(sampled["baseline"]).content_tokens}


def _blocks(annotated: str) -> list[str]:
  return block_texts(annotated) or []  # well-formed samples parse; anything else has no blocks to compare


def _metrics(candidate: dict) -> dict:
  return {k: candidate[k] for k in ("speedup", "quality", "score")}


def summarize(out: Path, ids: set[str]) -> BuildSummary:
  scores = [r for r in runfiles.read_rows(out / SCORES) if r["id"] in ids]
  pairs = [r for r in runfiles.read_rows(out / PAIRS) if r["id"] in ids]
  flags = [c["well_formed"] for r in scores for c in r["candidates"]]

  def mean(side: str, field: str) -> float:
    return sum(p[side][field] for p in pairs) / len(pairs) if pairs else math.nan

  return BuildSummary(
      prompts=len(scores), pairs=len(pairs), dropped=dict(Counter(r["reason"] for r in scores if r["reason"])),
      well_formed_share=sum(flags) / len(flags) if flags else 0.0,
      chosen_speedup=mean("chosen", "speedup"), rejected_speedup=mean("rejected", "speedup"),
      chosen_quality=mean("chosen", "quality"), rejected_quality=mean("rejected", "quality"))
