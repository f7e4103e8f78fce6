"""Sampling N PASTA answers per prompt with the batched interpreter, and the baseline's greedy answer.

Each prompt is repeated N times in one interpreter batch: requests never interact, and each row's
RNG is folded from its request index, so the N rows are N independent samples of one prompt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tqdm import tqdm

from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import TagError
from pasta_jax.lang import metrics
from pasta_jax.methods import Pasta, generate_ids
from pasta_jax.preference.config import PreferenceConfig


@dataclasses.dataclass(frozen=True)
class Sample:
  """One decoded answer, kept as the exact token ids the model produced (log p(y|x) is over them)."""

  annotated: str  # promise form
  text: str  # tags stripped
  ids: tuple[int, ...]  # the annotated answer's ids, end id included when it finished
  critical_path: int  # decode steps with unlimited lanes (0 when malformed)
  content_tokens: int
  well_formed: bool  # finished, not truncated, tags parse: trainable

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), "ids": list(self.ids)}

  @classmethod
  def from_json(cls, row: dict) -> Sample:
    return cls(**{**row, "ids": tuple(row["ids"])})


def to_sample(result: api.PastaResult, vocab) -> Sample:
  ids = metrics.annotated_from_records(result.records, vocab)
  ok = result.finished and not result.truncated and not math.isnan(result.theoretical_speedup)
  path = 0
  if ok:
    try:
      path = metrics.critical_path(ids, vocab)
    except TagError:
      ok = False
  return Sample(result.annotated, result.text, tuple(int(t) for t in ids), path, result.content_tokens, ok)


def _decode(model, prompts: Sequence[str], cfg: PreferenceConfig, sampling: SamplingConfig) -> list[Sample]:
  ids = api.prompt_ids(model.tokenizer, list(prompts), cfg.chat)
  results = generate_ids(model, ids, Pasta(lanes=cfg.lanes), max_new_tokens=cfg.max_new_tokens, sampling=sampling)
  vocab = model.tokenizer.tag_vocab()
  return [to_sample(r, vocab) for r in results]


def sample_answers(model, prompts: Sequence[str], cfg: PreferenceConfig, *, seed: int) -> list[list[Sample]]:
  """N samples per prompt at temperature T: [len(prompts)][N], all prompts in one batch."""
  repeated = [p for p in prompts for _ in range(cfg.num_samples)]
  sampling = SamplingConfig(temperature=cfg.temperature, seed=seed)
  flat = _decode(model, repeated, cfg, sampling)
  n = cfg.num_samples
  return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]


def greedy_answers(model, prompts: Sequence[str], cfg: PreferenceConfig, progress: bool = False) -> list[Sample]:
  """The Baseline-SFT model's greedy answers (batched, in runs of `requests_per_run`)."""
  out = []
  step = cfg.requests_per_run
  for start in tqdm(range(0, len(prompts), step), desc="baseline", unit="run", disable=not progress, leave=False):
    out += _decode(model, prompts[start:start + step], cfg, SamplingConfig())
  return out
