"""APAR through the public decode API: forced APAR answers replay exactly in tree order, whatever the
lane count; the thread numbering of `tree.thread_scripts` matches the interpreter's schedule; peak
live KV slots fall below the sequential baseline's on list-shaped answers; bad text form is refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.apar_text import encode_apar_text
from pasta_jax.decode.api import LangTokenizer, prompt_ids
from pasta_jax.errors import TagError
from pasta_jax.lang import apar_tree as tree
from pasta_jax.methods import Apar, generate
from tests.tiny import tiny_model

MODEL = tiny_model()
VOCAB = MODEL.tokenizer.tag_vocab()
LANG = LangTokenizer(MODEL.tokenizer)
LIST = ("Tips:\n1. Sleep:<fork/><child> go to bed on time.</child>\n2. Stress:<fork/><child> breathe slowly,"
        " then relax.</child>\n3. Food:<fork/><child> eat light at night.</child>\nGood luck.")
NESTED = "A:<fork/><child> x<fork/><child> deep</child> y</child> B:<fork/><child> z</child> end"


def strip(text: str) -> str:
  return text.replace("<fork/>", "").replace("<child>", "").replace("</child>", "")


@pytest.mark.parametrize("lanes", [3, 4])
@pytest.mark.parametrize("answer", [LIST, NESTED, "no forks at all"])
def test_forced_apar_answers_replay_in_tree_order(answer, lanes):
  (result,) = generate(MODEL, ["q"], Apar(lanes=lanes), forced_answers=[answer])
  assert result.finished and not result.truncated
  assert result.annotated == answer and result.text == strip(answer)
  assert len(result.thread_texts) == 1 + answer.count("<fork/>")


@pytest.mark.parametrize("answer, lanes", [(LIST, 1), (NESTED, 2)])
def test_a_forced_deadlock_stops_cleanly(answer, lanes):
  """Every running lane waits on a fork no lane can take: the run stops at once as truncated,
  keeping what was written (the step budget is not spent spinning)."""
  (result,) = generate(MODEL, ["q"], Apar(lanes=lanes), forced_answers=[answer])
  assert result.truncated and not result.finished and result.steps < 40
  assert strip(answer).startswith(result.text.split(" B:")[0].split("\n1.")[0])


def test_peak_live_slots_below_sequential_on_a_list():
  (apar,) = generate(MODEL, ["q"], Apar(lanes=4), forced_answers=[LIST])
  prompt = len(prompt_ids(MODEL.tokenizer, ["q"], chat=True)[0])
  sequential_peak = prompt + len(LANG.encode(strip(LIST)))  # plain decoding keeps every token
  assert apar.peak_live_slots < sequential_peak
  assert apar.critical_path < apar.content_tokens and apar.theoretical_speedup > 1


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(st.text("abc ", min_size=1, max_size=4),
                    lambda inner: st.lists(st.one_of(inner, inner.map(lambda x: f"<fork/><child>{x}</child>")),
                                           min_size=1, max_size=4).map("".join), max_leaves=8),
       st.integers(2, 5))
def test_thread_numbering_matches_the_interpreter(answer, lanes):
  (result,) = generate(MODEL, ["q"], Apar(lanes=lanes, max_threads=16), forced_answers=[answer])
  if lanes > answer.count("<fork/>"):  # a lane for every thread: no stall can deadlock
    assert not result.truncated
  if not result.truncated:
    assert result.annotated == answer and result.text == strip(answer)


@pytest.mark.parametrize("bad, needle", [
    ("a<fork/>b", "must be followed by <child>"), ("a<child>b</child>", "without <fork/>"),
    ("a</child>", "without an open"), ("a<fork/><child>b", "never closed")])
def test_malformed_apar_text_names_the_place(bad, needle):
  with pytest.raises(TagError, match=needle):
    encode_apar_text(bad, LANG, VOCAB)
  with pytest.raises(TagError, match="forced answer 0"):
    generate(MODEL, ["q"], Apar(), forced_answers=[bad])


def test_critical_path_by_hand():
  f, c, e = VOCAB.apar_fork, VOCAB.apar_child, VOCAB.eos_ids[0]
  root = tree.parse_tree([1 + 200, f, c, 300, 301, 302, e, 400], VOCAB)
  # main: t0 (step 1), FORK (2), t400 (3); child: CHILD with the fork (2), 300 301 302 (3, 4, 5)
  assert tree.critical_path(root, VOCAB) == 5 + 0 and len(root.tokens) == 3
