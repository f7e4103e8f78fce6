"""Preference data: scoring (against an independent NumPy reading of the paper), sampling through the
batched interpreter, the resumable pipeline, and the stored reference log-probs."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import ConfigError, PastaError
from pasta_jax.judges.base import Verdict
from pasta_jax.lang import metrics
from pasta_jax.methods import Pasta, generate_ids
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.runfiles import read_rows
from pasta_jax.preference import scoring
from pasta_jax.preference.build import PAIRS, SAMPLES, SCORES, Samplers, build_pairs
from pasta_jax.preference.config import PreferenceConfig
from pasta_jax.preference.dataset import encode_pair, pair_dataset
from pasta_jax.preference.reference import add_reference_logprobs
from pasta_jax.preference.sampling import sample_answers, to_sample
from pasta_jax.training.losses import sequence_logprob
from tests.tiny import tiny_model
from tests.training_data import ENCODE

# --- scoring ------------------------------------------------------------------------------------------
probs = st.floats(0.0, 1.0)


def numpy_quality(p_answer, floor):
  """The paper's ratio read independently: preference = side with p > .5, confidence = its probability."""
  p = np.asarray(p_answer, np.float64)
  conf = np.maximum(p, 1 - p)
  wins = np.sum(np.where(p > 0.5, conf, 0.0)) + 0.5 * np.sum(p == 0.5)
  losses = np.sum(np.where(p < 0.5, conf, 0.0)) + 0.5 * np.sum(p == 0.5)
  return wins / max(losses, floor)


@settings(max_examples=80, deadline=None)
@given(st.lists(probs, min_size=1, max_size=8), st.sampled_from([0.1, 0.25, 1.0]))
def test_quality_matches_numpy(ps, floor):
  judgements = [scoring.Judgement("baseline", k % 2 == 0, p) for k, p in enumerate(ps)]
  assert scoring.quality(judgements, floor) == pytest.approx(numpy_quality(ps, floor), rel=1e-12)


def test_quality_hand_computed():
  # beats the baseline with .9 and .7, loses to the reference with .8 (p=.2) and ties once
  judgements = [scoring.Judgement("baseline", True, 0.9), scoring.Judgement("baseline", False, 0.7),
                scoring.Judgement("reference", True, 0.2), scoring.Judgement("reference", False, 0.5)]
  assert scoring.wins_and_losses(judgements) == pytest.approx((2.1, 1.3))
  assert scoring.quality(judgements, 0.25) == pytest.approx(2.1 / 1.3)


class OrderedJudge:
  """P(first better) from a fixed preference table, with a position bias the both-orders read cancels."""

  name = "ordered"

  def __init__(self, better: dict[tuple[str, str], float], bias: float = 0.1):
    self.better, self.bias, self.calls = better, bias, []

  def compare(self, instruction, first, second):
    self.calls.append((instruction, first, second))
    p = self.better.get((first, second), 1 - self.better.get((second, first), 0.5))
    return Verdict(min(1.0, max(0.0, p + self.bias)))


def test_judge_against_uses_both_orders_and_cancels_bias():
  judge = OrderedJudge({("a", "b"): 0.8})
  got = scoring.judge_against(judge, "q", "a", {"baseline": "b"})
  assert [(j.answer_first, round(j.p_answer, 6)) for j in got] == [(True, 0.9), (False, 0.7)]
  assert [c[1:] for c in judge.calls] == [("a", "b"), ("b", "a")]


def test_duplicate_blocks_cost_their_share_of_the_score():
  repeated = ["1. Eat more fruit every day.", "1. Eat more fruit every day."]
  distinct = ["1. Eat more fruit every day.", "2. Sleep eight hours a night."]
  assert scoring.duplicate_share(repeated) == 1.0 and scoring.duplicate_share(distinct) == 0.0
  fast_dupes = scoring.score(2.0, 0.0, 0.0, duplicate_cost=1.0 * scoring.duplicate_share(repeated))
  slower_distinct = scoring.score(1.5, 0.0, 0.0, duplicate_cost=1.0 * scoring.duplicate_share(distinct))
  assert scoring.best_and_worst([fast_dupes, slower_distinct]) == (1, 0)  # the penalty flips the pair
  assert scoring.best_and_worst([scoring.score(2.0, 0.0, 0.0), scoring.score(1.5, 0.0, 0.0)]) == (0, 1)
  assert scoring.score(1.5, 2.0, math.inf, duplicate_cost=0.5) == (2.0, 1.0)
  with pytest.raises(ConfigError, match="duplicate_penalty"):
    PreferenceConfig(duplicate_penalty=-1.0)


def test_score_and_pair_selection():
  assert scoring.score(1.5, 2.0, 4.0) == (9.5, 0.0)
  assert scoring.score(1.5, 2.0, math.inf) == (2.0, 1.5)  # quality only, speedup breaks ties
  assert scoring.best_and_worst([(1.0, 0.0), (3.0, 0.0), (0.5, 0.0)]) == (1, 2)
  assert scoring.best_and_worst([(2.0, 1.0), (2.0, 3.0)]) == (1, 0)
  assert scoring.best_and_worst([(1.0, 0.0), (1.0, 0.0)]) is None
  with pytest.raises(ConfigError, match="num_samples"):
    PreferenceConfig(num_samples=1)
  with pytest.raises(ConfigError, match="temperature"):
    PreferenceConfig(temperature=0.0)


# --- sampling through the interpreter -----------------------------------------------------------------
def test_samples_are_independent_rows_of_one_batch():
  model = tiny_model()
  # the random tiny model's logits span ~80 nats: T = 1 would be greedy in effect
  cfg = PreferenceConfig(num_samples=4, max_new_tokens=12, lanes=2, temperature=40.0)
  got = sample_answers(model, ["ab", "cd"], cfg, seed=4)
  assert [len(s) for s in got] == [4, 4]
  assert len({s.ids for s in got[0]}) > 1  # T = 1: the N rows differ
  again = sample_answers(model, ["ab", "cd"], cfg, seed=4)
  assert [[s.ids for s in row] for row in got] == [[s.ids for s in row] for row in again]
  assert not any(s.well_formed for row in got for s in row)  # with this seed no 12-token sample draws an end


ANSWERS = [
    'Two:<promise topic="a" tokens="10"/><async>one fish</async><promise topic="b" tokens="10"/>'
    '<async>two fish</async><sync/>done',
    "one fish, two fish, red fish. done",
    'Fish:<promise topic="r" tokens="10"/><async>red</async><sync/>blue fish',
]


def forced_sample(model, prompts, cfg, *, seed):
  """The real interpreter path, with scripted answers: prompt i's sample j replays ANSWERS[(i+j+seed) % 3]."""
  repeated = [p for p in prompts for _ in range(cfg.num_samples)]
  forced = [ANSWERS[(i // cfg.num_samples + i % cfg.num_samples + seed) % 3] for i in range(len(repeated))]
  ids = api.prompt_ids(model.tokenizer, repeated, cfg.chat)
  results = generate_ids(model, ids, Pasta(lanes=cfg.lanes), forced_answers=forced, max_new_tokens=cfg.max_new_tokens,
                         sampling=SamplingConfig(temperature=cfg.temperature, seed=seed))
  flat = [to_sample(r, model.tokenizer.tag_vocab()) for r in results]
  n = cfg.num_samples
  return [flat[k * n:(k + 1) * n] for k in range(len(prompts))]


def forced_greedy(model, prompts, cfg):
  ids = api.prompt_ids(model.tokenizer, list(prompts), cfg.chat)
  results = generate_ids(model, ids, Pasta(lanes=cfg.lanes),
                         forced_answers=["one fish two fish red fish blue fish"] * len(prompts),
                         max_new_tokens=cfg.max_new_tokens)
  return [to_sample(r, model.tokenizer.tag_vocab()) for r in results]


class CountingSamplers(Samplers):
  pass


def records(n=3):
  return [{"id": f"r{i}", "instruction": f"Fish {i}", "output": "a reference answer"} for i in range(n)]


class LongerIsBetter:
  """Prefers the longer answer, confidence growing with the length gap; can be told to fail."""

  name = "longer"

  def __init__(self, fail_after: int | None = None):
    self.calls, self.fail_after = [], fail_after

  def compare(self, instruction, first, second):
    if self.fail_after is not None and len(self.calls) >= self.fail_after:
      raise KeyboardInterrupt("judge stopped")
    self.calls.append((instruction, first, second))
    return Verdict(1 / (1 + math.exp(-(len(first) - len(second)) / 5)))


CFG = PreferenceConfig(num_samples=3, max_new_tokens=64, lanes=4, quality_weight=1.0)


def test_pipeline_pairs_are_best_and_worst_by_the_paper_score(tmp_path):
  model = tiny_model()
  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  summary = build_pairs(model, model, records(), LongerIsBetter(), CFG, tmp_path, samplers=samplers, progress=False)
  assert summary.prompts == 3 and summary.pairs == 3 and summary.well_formed_share == 1.0
  vocab = model.tokenizer.tag_vocab()
  sampled = {r["id"]: r for r in read_rows(tmp_path / SAMPLES)}
  for pair in read_rows(tmp_path / PAIRS):
    row = sampled[pair["id"]]
    base_tokens = row["baseline"]["content_tokens"]
    keys = []
    for s in row["samples"]:
      speedup = base_tokens / metrics.critical_path(s["ids"], vocab)
      ps = []
      for other in (row["baseline"]["text"], row["reference"]):
        ps += [1 / (1 + math.exp(-(len(s["text"]) - len(other)) / 5)),
               1 - 1 / (1 + math.exp(-(len(other) - len(s["text"])) / 5))]
      keys.append(speedup + numpy_quality(ps, CFG.loss_floor))
    assert pair["chosen"]["score"] == pytest.approx(max(keys)) and pair["rejected"]["score"] == pytest.approx(min(keys))
    assert pair["chosen"]["ids"] == row["samples"][int(np.argmax(keys))]["ids"]


def test_pipeline_resumes_without_resampling_or_rejudging(tmp_path):
  from pasta_jax.judges import CachedJudge

  model = tiny_model()
  sample_calls = []

  def counted_sample(*args, **kw):
    sample_calls.append(1)
    return forced_sample(*args, **kw)

  samplers = Samplers(sample=counted_sample, greedy=forced_greedy)
  cfg = PreferenceConfig(num_samples=3, max_new_tokens=64, lanes=4, requests_per_run=3)  # one prompt per run
  first = LongerIsBetter(fail_after=14)  # 12 judgements per prompt: dies inside prompt 2
  with pytest.raises(KeyboardInterrupt):
    build_pairs(model, model, records(), CachedJudge(first, tmp_path / "verdicts.jsonl"), cfg, tmp_path,
                samplers=samplers, progress=False)
  assert len(sample_calls) == 3 and len(list(read_rows(tmp_path / SCORES))) == 1
  second = LongerIsBetter()
  summary = build_pairs(model, model, records(), CachedJudge(second, tmp_path / "verdicts.jsonl"), cfg, tmp_path,
                        samplers=samplers, progress=False)
  assert len(sample_calls) == 3  # nothing re-sampled
  ordered = first.calls + second.calls
  assert len(ordered) == len(set(ordered))  # no ordered pair judged twice
  assert summary.pairs == 3


def test_speed_only_needs_no_judge_and_quality_needs_one(tmp_path):
  model = tiny_model()
  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  with pytest.raises(PastaError, match="needs a judge"):
    build_pairs(model, model, records(1), None, CFG, tmp_path / "a", samplers=samplers, progress=False)
  import dataclasses
  speed = dataclasses.replace(CFG, quality_weight=0.0)
  build_pairs(model, model, records(2), None, speed, tmp_path / "b", samplers=samplers, progress=False)
  for pair in read_rows(tmp_path / "b" / PAIRS):
    assert pair["chosen"]["speedup"] > pair["rejected"]["speedup"]


def test_rouge_quality_is_the_ratio_to_the_baseline_with_a_floor():
  reference = "red fish blue fish"
  assert scoring.rouge_quality("red fish blue fish", "red fish", reference) == pytest.approx(1 / metrics.rouge_l(
      "red fish", reference))
  assert scoring.rouge_quality("red fish", "red fish", reference) == 1.0
  # a baseline with no overlap: divided by the floor, not by zero
  assert scoring.rouge_quality("red fish", "cats", reference) == pytest.approx(
      metrics.rouge_l("red fish", reference) / scoring.ROUGE_FLOOR)


def test_rouge_quality_ranks_samples_by_speed_plus_lambda_rouge_without_a_judge(tmp_path):
  import dataclasses
  model = tiny_model()
  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  cfg = dataclasses.replace(CFG, quality_measure="rouge", speed_measure="parallelism", quality_weight=3.0)
  fish = [{"id": f"r{i}", "instruction": f"Fish {i}", "output": "red fish and blue fish"} for i in range(3)]
  summary = build_pairs(model, model, fish, None, cfg, tmp_path, samplers=samplers, progress=False)
  assert summary.pairs == 3
  vocab = model.tokenizer.tag_vocab()
  sampled = {r["id"]: r for r in read_rows(tmp_path / SAMPLES)}
  for pair in read_rows(tmp_path / PAIRS):
    row = sampled[pair["id"]]
    base_rouge = max(metrics.rouge_l(row["baseline"]["text"], row["reference"]), 0.05)
    keys = [s["content_tokens"] / metrics.critical_path(s["ids"], vocab)
            + 3.0 * metrics.rouge_l(s["text"], row["reference"]) / base_rouge for s in row["samples"]]
    assert pair["chosen"]["score"] == pytest.approx(max(keys)) and pair["rejected"]["score"] == pytest.approx(min(keys))
  with pytest.raises(PastaError, match="1 of 1 records have none"):
    build_pairs(model, model, [{"id": "x", "instruction": "Fish"}], None, cfg, tmp_path / "b", samplers=samplers,
                progress=False)


def test_likelihood_quality_is_the_ratio_of_geometric_mean_token_probabilities():
  assert scoring.likelihood_quality(-1.0, -1.0) == 1.0
  assert scoring.likelihood_quality(math.log(0.2), math.log(0.4)) == pytest.approx(0.5)  # half as likely a token
  assert scoring.likelihood_quality(-0.5, -1.5) == pytest.approx(math.e)


def test_logp_quality_scores_samples_under_the_baseline_model_not_the_policy(tmp_path):
  import dataclasses

  from pasta_jax.eval.quality import answer_logprob
  policy, baseline = tiny_model(), tiny_model(seed=1)
  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  cfg = dataclasses.replace(CFG, quality_measure="logp", speed_measure="parallelism", quality_weight=2.0)
  summary = build_pairs(policy, baseline, records(3), None, cfg, tmp_path, samplers=samplers, progress=False)
  assert summary.pairs == 3
  vocab = policy.tokenizer.tag_vocab()
  sampled = {r["id"]: r for r in read_rows(tmp_path / SAMPLES)}
  scores = {r["id"]: r for r in read_rows(tmp_path / SCORES)}
  for pair in read_rows(tmp_path / PAIRS):
    row = sampled[pair["id"]]
    logp = lambda text, model=baseline, prompt=row["prompt"]: answer_logprob(model, prompt, text)[0]  # noqa: E731
    quality = [math.exp(logp(s["text"]) - logp(row["baseline"]["text"])) for s in row["samples"]]
    policy_quality = [math.exp(logp(s["text"], policy) - logp(row["baseline"]["text"], policy))
                      for s in row["samples"]]
    assert not np.allclose(quality, policy_quality)  # the two scorers disagree, so the check below tells them apart
    got = [c["quality"] for c in scores[pair["id"]]["candidates"]]
    assert got == pytest.approx(quality, rel=1e-5)
    keys = [s["content_tokens"] / metrics.critical_path(s["ids"], vocab) + 2.0 * q
            for s, q in zip(row["samples"], quality)]
    assert pair["chosen"]["score"] == pytest.approx(max(keys)) and pair["rejected"]["score"] == pytest.approx(min(keys))


def test_reference_logprobs_are_the_training_layouts_logprobs(tmp_path):
  model = tiny_model()
  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  build_pairs(model, model, records(), LongerIsBetter(), CFG, tmp_path, samplers=samplers, progress=False)
  pairs = add_reference_logprobs(tmp_path / PAIRS, model, ENCODE, batch_size=2, progress=False)
  stored = list(read_rows(tmp_path / PAIRS))
  assert stored == json.loads(json.dumps(pairs))
  apply_fn = Gemma(model.config).apply
  vocab = model.tokenizer.tag_vocab()
  for pair in stored:
    chosen, rejected = encode_pair(pair, model.tokenizer, vocab, ENCODE)  # padded as training pads
    for layout, side in ((chosen, "chosen"), (rejected, "rejected")):
      want = float(sequence_logprob(apply_fn, model.params, jax_batch(layout))[0])
      assert pair[side]["ref_logp"] == pytest.approx(want, rel=1e-5)
  # a second call computes nothing new; another model's values are refused
  assert add_reference_logprobs(tmp_path / PAIRS, model, ENCODE, progress=False) == pairs
  other = tiny_model(seed=1)._replace(source="another")
  with pytest.raises(PastaError, match="reference log-probs were computed with"):
    add_reference_logprobs(tmp_path / PAIRS, other, ENCODE, progress=False)
  ds = pair_dataset(stored, model.tokenizer, vocab, ENCODE, batch_size=2, seed=0, epochs=2)
  assert len(ds) == 2 and ds[0].chosen.tokens.shape == (2, ENCODE.seq_len) and ds[1].ref_chosen.shape == (2,)


def jax_batch(layout):
  import jax
  return jax.tree.map(lambda x: jnp.asarray(x)[None], layout)


# --- rounds: sample -> score -> BoNBoN, each round from the last model ---------------------------------
@pytest.mark.parametrize("reference", ["sft", "round_start"])
def test_two_rounds_chain_models_and_raise_the_margin(tmp_path, reference):
  from pasta_jax.model.checkpoint import restore_checkpoint
  from pasta_jax.model.load import LoadedModel
  from pasta_jax.preference.rounds import run_rounds
  from pasta_jax.training.config import TrainConfig
  from pasta_jax.training.metrics_log import read_metrics

  start = tiny_model()
  loads = []

  def load(path):  # the tiny model's char tokenizer is not saved with checkpoints: reattach it
    loads.append(path)
    if path == "start":
      return start
    config, params = restore_checkpoint(path)
    return LoadedModel(config, params, start.tokenizer, str(path))

  samplers = Samplers(sample=forced_sample, greedy=forced_greedy)
  train = TrainConfig(model="tiny", batch_size=2, seq_len=ENCODE.seq_len, num_threads=ENCODE.num_threads,
                      learning_rate=1e-3, epochs=3, bonbon_beta=1.0, save_every=100)
  results = run_rounds(2, "start", start, records(4), lambda folder: LongerIsBetter(), CFG, train, tmp_path,
                       load=load, samplers=samplers, progress=False, reference=reference)
  assert [r.index for r in results] == [1, 2] and all(r.model_dir for r in results)
  # round 2 starts from round 1's exported model; with the paper's reference it loads the SFT model again
  assert loads == ["start", results[0].model_dir] + (["start"] if reference == "sft" else [])
  assert results[1].start_model == results[0].model_dir
  for r in results:
    rows = read_metrics(tmp_path / f"round_{r.index}" / "train")
    assert all(math.isfinite(row["loss"]) for row in rows)
  # a round that starts from its reference starts at margin 0 and raises it
  rising = [1, 2] if reference == "round_start" else [1]
  for index in rising:
    margins = [row["margin"] for row in read_metrics(tmp_path / f"round_{index}" / "train")]
    assert margins[0] == pytest.approx(0.0, abs=1e-3) and margins[-1] > margins[0]
  # the forced samplers give both rounds the same pairs: round 2's reference log-probs equal round 1's
  # exactly when both come from the SFT model, and differ when round 2's reference is round 1's model
  ref1 = [p["chosen"]["ref_logp"] for p in read_rows(tmp_path / "round_1" / "pairs" / PAIRS)]
  ref2 = [p["chosen"]["ref_logp"] for p in read_rows(tmp_path / "round_2" / "pairs" / PAIRS)]
  assert (ref1 == ref2) == (reference == "sft")
  loaded = len(loads)
  # a finished round is skipped on a rerun
  again = run_rounds(2, "start", start, records(4), lambda folder: LongerIsBetter(), CFG, train, tmp_path,
                     load=load, samplers=samplers, progress=False, reference=reference)
  assert [r.summary for r in again] == [None, None] and len(loads) == loaded


def test_the_parallelism_measure_does_not_reward_a_shorter_answer():
  from pasta_jax.preference.build import speed
  from pasta_jax.preference.sampling import Sample

  def answer(tokens, path):
    return Sample("", "", (), critical_path=path, content_tokens=tokens, well_formed=True)

  baseline = answer(100, 100)
  short_serial, long_parallel = answer(40, 40), answer(100, 50)
  assert speed(short_serial, baseline, "speedup") > speed(long_parallel, baseline, "speedup")  # the paper's: 2.5 > 2
  assert speed(short_serial, baseline, "parallelism") == 1.0 < speed(long_parallel, baseline, "parallelism") == 2.0
  with pytest.raises(ConfigError, match="speed_measure"):
    PreferenceConfig(speed_measure="tokens")
