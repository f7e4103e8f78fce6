"""The public decode API on a tiny random Gemma with a character-level tokenizer (fast, no weights).

Forced replays make the outputs independent of the random weights, so the checks are exact: the
clean text, the annotated round trip, the thread trace and the metrics. One batch compiles once.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.commands.pasta_view import compress, summary, trace_lines
from pasta_jax.data.structural import annotate
from pasta_jax.decode import api
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import metrics
from pasta_jax.lang.text import strip_tags
from pasta_jax.lang.tokens import encode_answer
from pasta_jax.methods import Pasta, generate
from pasta_jax.model.config import get_config
from pasta_jax.model.gemma import Gemma
from tests.tiny import CharTokenizer

ANSWER = ('Two tips:\n<promise topic="sleep" tokens="20"/><async>- Sleep eight hours.\n</async>'
          '<promise topic="food" tokens="10"/><async>- Eat greens.\n</async><sync/>Done.')
PLAIN = "No tags here."


@pytest.fixture(scope="module")
def model():
  config = get_config("tiny-gemma3")
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = Gemma(config).init(jax.random.key(0), tokens, tokens, jnp.ones((1, 4, 4), bool))
  return types.SimpleNamespace(config=config, params=params, tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def results(model):
  return generate(model, ["Give tips", "Say it"], Pasta(lanes=4), forced_answers=[ANSWER, PLAIN], max_new_tokens=96)


def test_forced_text_and_annotated_round_trip(results):
  tagged, plain = results
  assert tagged.text == strip_tags(ANSWER)
  assert tagged.annotated == ANSWER
  assert plain.text == plain.annotated == PLAIN
  assert tagged.finished and plain.finished and not tagged.truncated


def test_trace_is_consistent(model, results):
  tagged, plain = results
  vocab = model.tokenizer.tag_vocab()
  main, *forks = tagged.threads
  assert [t.thread for t in tagged.threads] == [0, 1, 2] and main.lane == 0 and main.spawn_step == 0
  for fork in forks:
    assert 0 < fork.spawn_step < fork.finish_step <= tagged.steps
    assert 1 <= fork.lane < 4
    assert fork.fed_steps == tuple(range(fork.spawn_step, fork.finish_step + 2))  # <async> ... </async>
  assert [f.tokens for f in forks] == [len("- Sleep eight hours.\n"), len("- Eat greens.\n")]
  assert main.tokens == len("Two tips:\n") + len("Done.")
  assert len(tagged.sync_steps) == 1 and tagged.sync_steps[0] >= max(f.finish_step for f in forks)
  ids = encode_answer(ANSWER, api.LangTokenizer(model.tokenizer), vocab)
  assert tagged.theoretical_speedup == pytest.approx(metrics.theoretical_speedup(ids, vocab))
  assert tagged.theoretical_speedup > 1.0
  assert tagged.steps == metrics.trace_steps(tagged.records, vocab) and tagged.stalls == 0
  assert tagged.tokens == len(ids) and tagged.content_tokens == len(strip_tags(ANSWER))
  assert plain.steps == len(PLAIN) and len(plain.threads) == 1 and plain.theoretical_speedup == 1.0
  assert tagged.seconds > 0 and isinstance(tagged.records, np.ndarray)


def test_malformed_forced_answer_names_the_place(model):
  bad = 'Hi <promise topic="x" tokens="10"/><async>never closed'
  with pytest.raises(TagError, match=r"forced answer 1: .*line 1, col"):
    generate(model, ["a", "b"], Pasta(), forced_answers=[ANSWER, bad])
  with pytest.raises(TagError, match="tokens"):
    generate(model, ["a"], Pasta(), forced_answers=['<promise topic="x" tokens="15"/><async>y</async>'])


@pytest.mark.parametrize("prompts", [[""], ["ok", "   "], []])
def test_empty_prompt_is_a_pasta_error(model, prompts):
  with pytest.raises(PastaError, match="prompt"):
    generate(model, prompts, Pasta())


def test_forced_answers_must_match_prompts(model):
  with pytest.raises(PastaError, match="2 prompts"):
    generate(model, ["a", "b"], Pasta(), forced_answers=[PLAIN])


def test_thread_chart(model, results):
  lines = trace_lines(results[0], model.tokenizer.tag_vocab())
  assert len(lines) == 3 and lines[0].lstrip().startswith("main") and "▒" in lines[0]
  assert compress(["█", " ", "▒", " "], width=2) == "█▒"


def test_the_summary_names_a_speedup_only_where_the_answer_has_one(results):
  tagged = results[0]
  assert f"theoretical speedup {tagged.theoretical_speedup:.2f}x;" in summary(tagged, 1.0)
  cut = dataclasses.replace(tagged, theoretical_speedup=math.nan)  # what a run cut inside a block gets
  line = summary(cut, 1.0)
  assert "theoretical speedup n/a (cut inside a block);" in line and "nan" not in line


def test_structural_annotator_keeps_every_character():
  answer = "Intro:\n\n1. First point here.\n2. Second\n   continued.\n\nIn short, yes.\n"
  annotated = annotate(answer, len)
  assert strip_tags(annotated) == answer
  assert annotated.count("<async>") == 2 and "<sync/>" in annotated
  assert '<promise topic="First point here"' in annotated
  assert annotate("1. only\n2. items\n", len).count("<async>") == 1  # the first item stays in main
  assert annotate("No list at all.", len) is None


def test_a_cut_answer_says_why(model, results):
  tagged, _ = results
  assert tagged.stop_reason == "end" and tagged.stop_note == ""
  free = generate(model, ["Say it"], Pasta(lanes=2), max_new_tokens=3)[0]  # a random model never ends in 3 tokens
  assert (free.finished, free.budget_spent, free.stop_reason, free.content_tokens) == (False, True, "tokens", 3)
  assert "content-token budget" in free.stop_note
  full = dataclasses.replace(free, budget_spent=False, pool_full=True)
  assert full.stop_reason == "pool" and "KV pool filled" in full.stop_note
  steps = dataclasses.replace(free, budget_spent=False)
  assert steps.stop_reason == "steps" and "step budget" in steps.stop_note
