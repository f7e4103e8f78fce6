"""Where the log p gap sits: block spans in the clean text, tokens placed in main or a block, per-token log p that
agrees with the per-answer mean, and both splits of a run's results."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings

from pasta_jax.eval.logp_gap import answer_split, token_places, token_split
from pasta_jax.eval.quality import answer_logprob, answer_token_logprobs
from pasta_jax.lang import text as T
from pasta_jax.lang.metrics import block_spans
from tests.lang_helpers import programs
from tests.tiny import tiny_model


@given(programs())
@settings(max_examples=100, deadline=None)
def test_block_spans_hold_each_block_of_the_clean_text(segments):
  clean, spans = block_spans(T.render(segments))
  assert clean == T.strip_tags(segments)
  blocks = [s.text for s in segments if isinstance(s, T.Block)]
  assert [clean[lo:hi] for lo, hi in spans] == blocks
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in order, apart


def test_block_spans_of_an_answer_that_does_not_parse():
  assert block_spans('a <promise topic="x" tokens="10"/><async>open') is None


def test_token_places_by_hand():
  # main "ab" (2 tokens), a block of 5 one-character tokens at [2, 7), main "c", the end token at 8
  places = token_places([0, 1, 2, 3, 4, 5, 6, 7, 8], [(2, 7)])
  assert places == ["main", "main"] + ["block start"] * 3 + ["block"] * 2 + ["main", "main"]
  # a token that starts inside a block belongs to it; each block counts its own first tokens
  assert token_places([0, 3, 5, 6], [(0, 4), (5, 9)], first=1) == ["block start", "block", "block start", "block"]


def test_token_logprobs_agree_with_the_answer_mean_and_place_every_token():
  model = tiny_model()
  prompt, answer = "Hi", "ok go now"
  values, starts = answer_token_logprobs(model, prompt, answer, bucket=16)
  mean, count = answer_logprob(model, prompt, answer, bucket=16)
  assert len(values) == len(starts) == count
  assert math.isclose(float(np.mean(values)), mean, rel_tol=1e-6)
  assert starts[0] == 0 and starts[-1] == len(answer) and np.all(np.diff(starts) > 0)
  ids = model.tokenizer.encode(answer, add_bos=False)
  pieces = [answer[lo:hi] for lo, hi in zip(starts[:-1], starts[1:])]
  assert pieces == [model.tokenizer.decode([i]) for i in ids]


def _results(runs: list[tuple[str, str, int, bool]]) -> dict:
  """A bench.learned results dict: per prompt (PASTA annotated, baseline text, PASTA threads, baseline finished)."""
  prompts = []
  for k, (annotated, base_text, threads, finished) in enumerate(runs):
    parsed = block_spans(annotated)
    text = parsed[0] if parsed else annotated
    prompts.append(dict(id=str(k), instruction=f"p{k}", runs={
        "pasta": dict(annotated=annotated, text=text, threads=threads, finished=True),
        "base": dict(annotated=base_text, text=base_text, threads=1, finished=finished)}))
  return dict(prompts=prompts)


FORKED = '1. <promise topic="x" tokens="10"/><async>abcdef</async>2. gh'


def test_answer_split_groups_each_prompt_beside_its_baseline():
  results = _results([(FORKED, "bbbb", 2, True), ("plain", "bb", 1, False), ("pl", "bbbbbb", 1, True)])
  split = answer_split(results, "pasta", "base", lambda prompt, text: -float(len(text)))
  forked, plain = split["forked"], split["not forked"]
  assert (forked["n"], forked["pasta"], forked["baseline"]) == (1, -len(T.strip_tags(FORKED)), -4.0)
  assert (plain["n"], plain["pasta"], plain["baseline"]) == (2, -3.5, -4.0)
  assert split["baseline cut"]["n"] == 1 and split["baseline finished"]["pasta"] == pytest.approx((-14 - 2) / 2)
  assert plain["gap"] == pytest.approx((-3.5 + 4.0) / 4.0)


def test_token_split_places_main_and_block_tokens_of_forked_answers_only():
  def token_logp(prompt, text):  # one token a character, -2 inside the block "abcdef", -1 elsewhere
    lo = text.index("abcdef")
    values = [-2.0 if lo <= i < lo + 6 else -1.0 for i in range(len(text))] + [-1.0]
    return np.asarray(values), np.arange(len(text) + 1)

  cut = '1. <promise topic="x" tokens="10"/><async>open'  # forked, but its tags do not parse: not placed
  split = token_split(_results([(FORKED, "b", 2, True), ("plain", "b", 1, True), (cut, "b", 2, True)]),
                      "pasta", token_logp)
  assert split["unplaced"] == 1
  assert split["main"] == dict(tokens=len("1. 2. gh") + 1, logprob=-1.0)
  assert split["block"] == dict(tokens=6, logprob=-2.0) and split["block start"] == dict(tokens=3, logprob=-2.0)
