"""APAR-format data (the APAR paper's Appendix B rules): fixed and adversarial texts, and the
invariant that removing the tags gives every answer back byte for byte."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.data.apar_format import apar_annotate, apar_records, strip_apar
from pasta_jax.data.sources import read_records

INSOMNIA = ("Here are some advice:\n1. Establish a Routine: Go to bed at the same time every day.\n"
            "2. Manage Stress: Consider relaxation such as breathing exercises.\n"
            "3. Limit Screens: Avoid phones an hour before bed.\n\nIf it persists, seek advice.")


def test_ordered_list_forks_after_each_title():
  result = apar_annotate(INSOMNIA)
  assert result.kind == "ordered_list"
  assert result.annotated == (
      "Here are some advice:\n1. Establish a Routine:<fork/><child> Go to bed at the same time every day.\n"
      "</child>2. Manage Stress:<fork/><child> Consider relaxation such as breathing exercises.\n</child>"
      "3. Limit Screens:<fork/><child> Avoid phones an hour before bed.\n</child>\nIf it persists, seek advice.")


@pytest.mark.parametrize("text, kind", [
    ("1. A: aaaaaaaaaaaa\n2. B: bbbbbbbbbbbb", "paragraph"),  # 2 items: not a list; no 2-sentence para
    ("First sentence here. Second one follows.\n\nAlone.", "paragraph"),
    ("Use this:\n```python\nprint(1)\n```\nDone. Really done.", "unstructured"),
    ("See https://example.com for more. It helps.", "unstructured"),
    ("| a | b |\n| 1 | 2 |", "unstructured"),
    ("Solve $x^2$ now. Then rest.", "unstructured"),
    ("one line without a full stop", "unstructured"),
    ("Ünïcödé sentence one. Ωmega two follows. \r\n\r\nMore text. And more.", "paragraph"),
    ("1. x: short\n2. y: short\n3. z: short", "unstructured"),  # items under 10 characters of content
    ("text with <fork/> in it. Another sentence.", "unstructured"),
])
def test_kinds(text, kind):
  result = apar_annotate(text)
  assert result.kind == kind, result.reason
  if result.annotated is not None:
    assert strip_apar(result.annotated) == text


def test_paragraph_root_is_the_first_sentence():
  result = apar_annotate("Sleep matters. It restores the body.\n\nOne line.")
  assert result.annotated == "Sleep matters. <fork/><child>It restores the body.</child>\n\nOne line."


lines = st.one_of(st.text(min_size=0, max_size=30), st.builds(lambda n, t, d: f"{n}. {t}: {d}", st.integers(1, 9),
                                                                 st.text(max_size=10), st.text(max_size=30)))


@settings(max_examples=200, deadline=None)
@given(st.lists(lines, max_size=8).map("\n".join))
def test_stripping_gives_the_answer_back(answer):
  result = apar_annotate(answer)
  if result.annotated is not None:
    assert strip_apar(result.annotated) == answer


def test_lima_rows():
  rows, kinds = apar_records(read_records("lima"))
  assert kinds["ordered_list"] > 0 and kinds["paragraph"] > 0 and kinds["unstructured"] > 0
  assert all(strip_apar(r["apar"]) == r["output"] for r in rows if r["apar"] is not None)
