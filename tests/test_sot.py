"""Skeleton-of-Thought on the interpreter: point extraction, the fallback, each point's lane equal to
a plain decode of its own full prompt (it sees the shared prefix and itself only), and routers."""

from __future__ import annotations

import pytest

from pasta_jax.baselines import sot
from pasta_jax.errors import PastaError
from pasta_jax.methods import Apar, generate_ids
from tests.tiny import tiny_model

MODEL = tiny_model()
CFG = sot.SotConfig(point_tokens=12, skeleton_tokens=40, answer_tokens=16)


@pytest.mark.parametrize("text, points", [
    ("1. Sleep early\n2. Eat well\n3. Move", ["Sleep early", "Eat well", "Move"]),
    ("Here:\n1) a b\n 2) c d\nDone.", ["a b", "c d"]),
    ("1. one\n3. three\n2. two", ["one", "two"]),  # numbering must not skip: 3 waits for 2
    ("- 1. bullet one\n- 2. bullet two", ["bullet one", "bullet two"]),
    ("No outline here.\nJust prose.", []),
    ("1.\n2. empty first", []),
])
def test_extract_points(text, points):
  assert sot.extract_points(text, max_points=8) == points


def test_points_are_capped():
  assert len(sot.extract_points("\n".join(f"{i}. p{i}" for i in range(1, 13)), max_points=8)) == 8


def test_each_point_lane_equals_a_plain_decode_of_its_own_prompt():
  runner = sot.SkeletonOfThought(MODEL, CFG)
  result = runner.run("How to sleep?", forced_skeleton="1. Routine\n2. Light\n3. Calm")
  assert result.used_sot and result.points == ("Routine", "Light", "Calm")
  shared, suffixes = sot.expansion_inputs(MODEL.tokenizer, "How to sleep?", result.skeleton, result.points, True)
  for suffix, expansion in zip(suffixes, result.expansions, strict=True):
    [alone] = generate_ids(MODEL, [shared + suffix], Apar(lanes=1, max_threads=1, max_depth=0),
                           max_new_tokens=CFG.point_tokens)
    n = min(len(alone.text), len(expansion))
    assert n > 0 and expansion[:n] == alone.text[:n]
  assert result.text.startswith("1. Routine:") and "\n2. Light:" in result.text and "\n3. Calm:" in result.text


def test_no_skeleton_falls_back_to_normal_decoding():
  runner = sot.SkeletonOfThought(MODEL, CFG)
  result = runner.run("Hi?", forced_skeleton="just prose, no list")
  assert not result.used_sot and "no skeleton" in result.note
  plain_method = Apar(lanes=1, max_threads=1, max_depth=0)
  [plain] = generate_ids(MODEL, [sot._chat_ids(MODEL.tokenizer, "Hi?", True)], plain_method,
                         max_new_tokens=CFG.answer_tokens)
  assert result.text == plain.text


def test_rule_router():
  router = sot.RuleRouter()
  assert router.use_sot("Give me tips to sleep better")
  assert not router.use_sot("Write python code to sort a list of tips")
  assert not router.use_sot("Who is the president of France?")
  result = sot.SkeletonOfThought(MODEL, CFG, router=router).run("Who is Ada?", forced_skeleton="1. a\n2. b")
  assert not result.used_sot and result.note == "router chose normal decoding"


def test_model_router_needs_single_yes_no_tokens():
  with pytest.raises(PastaError, match="no single token for 'yes'"):
    sot.ModelRouter(MODEL)


def test_skeleton_from_an_answers_list_items():
  answer = "Tips:\n- Keep a fixed bedtime daily.\n- Avoid screens late.\n\nDone."
  assert sot.skeleton_from_answer(answer, 8) == "1. Keep a fixed bedtime\n2. Avoid screens late"
  assert sot.skeleton_from_answer("No list here.", 8) is None
  result = sot.SkeletonOfThought(MODEL, CFG).run("Tips?", forced_skeleton=sot.skeleton_from_answer(answer, 8))
  assert result.used_sot and result.points == ("Keep a fixed bedtime", "Avoid screens late")
