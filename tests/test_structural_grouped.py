"""The grouped structural annotator: each list forks as a few long blocks, its last group stays in main."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.data.structural import split_items
from pasta_jax.data.structural_grouped import Grouping, annotate_grouped, balanced_cuts, list_runs
from pasta_jax.errors import ConfigError
from pasta_jax.lang import text as T


def count_words(text: str) -> int:
  return len(text.split())  # one token per word keeps the arithmetic visible


def blocks_and_promises(annotated: str) -> list[tuple[T.Promise, str]]:
  segments = T.parse(annotated)
  return [(s, segments[i + 1].text) for i, s in enumerate(segments) if isinstance(s, T.Promise)]


TIPS = ("Tips:\n1. Eat well: fruit and greens every day.\n2. Sleep: eight hours a night for adults.\n"
        "3. Move: walk for thirty minutes daily.\n4. Rest: breaks from screens help a lot.\n\nBe kind to yourself.\n")


def test_a_list_forks_as_groups_and_main_writes_the_last():
  annotated = annotate_grouped(TIPS, count_words, Grouping(max_blocks=1, min_block_tokens=8, numbered_per_item=False))
  [(promise, block)] = blocks_and_promises(annotated)
  assert block == "Eat well: fruit and greens every day.\n2. Sleep: eight hours a night for adults.\n"
  assert promise.topic == "1-2: Eat well, Sleep"  # the fork learns how many items it writes, and which, and
  # main reads its next number, 3, off the topic
  assert "</async>3. Move: walk" in annotated  # main writes the second group itself, after the promise
  assert annotated.index("Rest: breaks") < annotated.index(T.SYNC) < annotated.index("Be kind")
  assert T.strip_tags(annotated) == TIPS


@pytest.mark.parametrize("grouping, blocks", [
    (Grouping(max_blocks=3, min_block_tokens=7), 3),  # 4 items, 31 words: 4 groups, 3 fork
    (Grouping(max_blocks=3, min_block_tokens=12), 1),  # 31 words // 12: 2 groups, 1 forks
    (Grouping(max_blocks=3, min_block_tokens=16), 0),  # 31 words // 16: one group: nothing forks
])
def test_min_block_tokens_decides_how_many_groups(grouping, blocks):
  annotated = annotate_grouped(TIPS.replace("1. ", "- ").replace("2. ", "- ").replace("3. ", "- ").replace("4. ", "- "),
                               count_words, grouping)
  assert len(blocks_and_promises(annotated) if annotated else []) == blocks


def test_min_saving_keeps_lists_whose_topics_would_be_their_text_in_main():
  names = "Actors:\n- James Cagney\n- Peter Ustinov\n- John Gielgud\n- Laurence Olivier\n"
  forked = annotate_grouped(names, count_words, Grouping(max_blocks=3, min_block_tokens=3))
  assert [p.topic for p, _ in blocks_and_promises(forked)] == ["James Cagney", "Peter Ustinov", "John Gielgud"]
  # each block (3 words) minus its topic (2) and the promise's cost saves nothing: with min_saving, no fork
  assert annotate_grouped(names, count_words, Grouping(max_blocks=3, min_block_tokens=3, min_saving=1)) is None
  # fewer, larger groups are tried before giving up: 4 groups' first saves 8 - 2 - 3 = 3 words, 3 groups'
  # too, 2 groups' first 16 - 3 - 3 = 10
  tips = annotate_grouped(TIPS, count_words, Grouping(max_blocks=3, min_block_tokens=7, min_saving=4,
                                                      numbered_per_item=False))
  assert [p.topic for p, _ in blocks_and_promises(tips)] == ["1-2: Eat well, Sleep"]


def test_numbered_lists_fork_item_by_item_so_main_never_counts():
  annotated = annotate_grouped(TIPS, count_words, Grouping(max_blocks=2, min_saving=4))
  # items 1 and 2 save 8 - 2 - 3 = 3 < 4 and 8 - 1 - 3 = 4 words; the cap of 2 forks is not reached; 4 is last
  assert [(p.topic, block) for p, block in blocks_and_promises(annotated)] == [
      ("Sleep", "Sleep: eight hours a night for adults.\n")]
  assert "Tips:\n1. Eat well" in annotated and "</async>3. Move" in annotated  # main writes every marker
  capped = annotate_grouped(TIPS, count_words, Grouping(max_blocks=1, min_saving=1))
  assert [p.topic for p, _ in blocks_and_promises(capped)] == ["Eat well"]


def test_bad_grouping_is_refused():
  with pytest.raises(ConfigError, match="max_blocks"):
    Grouping(max_blocks=0)


sizes_and_groups = st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 5))


@settings(max_examples=60, deadline=None)
@given(sizes_and_groups)
def test_balanced_cuts_keep_every_group_near_its_share(case):
  sizes, groups = case
  starts = balanced_cuts(sizes, groups)
  assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == min(groups, len(sizes))
  bounds = [*starts, len(sizes)]
  for lo, hi in zip(bounds, bounds[1:]):
    assert sum(sizes[lo:hi]) * groups <= sum(sizes) + groups * max(sizes)


words = st.lists(st.sampled_from(["eat", "well", "sleep", "long", "walk", "daily", "rest"]), min_size=1, max_size=9)
item = st.tuples(st.sampled_from(["1. ", "7. ", "- ", "* "]), words, st.booleans())  # marker, words, blank line after
answer_lists = st.lists(st.lists(item, min_size=1, max_size=6), min_size=1, max_size=3)


def render_answer(lists, lead: bool, tail: bool) -> str:
  parts = ["Here you go:\n"] if lead else []
  for n, items in enumerate(lists):
    if n:
      parts.append(f"Part {n}:\n")
    parts += [marker + " ".join(ws) + ".\n" + ("\n" if blank else "") for marker, ws, blank in items]
  return "".join(parts + (["In short, rest.\n"] if tail else []))


def fork_spans(annotated: str) -> list[tuple[int, int]]:
  """[start, end) of each block's text in the tag-free answer."""
  spans, offset = [], 0
  for segment in T.parse(annotated):
    if isinstance(segment, T.Block):
      spans.append((offset, offset + len(segment.text)))
    offset += len(getattr(segment, "text", ""))
  return spans


@settings(max_examples=80, deadline=None)
@given(answer_lists, st.booleans(), st.booleans(), st.integers(1, 3), st.integers(2, 12), st.booleans())
def test_grouped_annotation_keeps_every_character_and_each_lists_last_group(lists, lead, tail, max_blocks, min_block,
                                                                          per_item):
  answer = render_answer(lists, lead, tail)
  annotated = annotate_grouped(answer, count_words, Grouping(max_blocks, min_block, numbered_per_item=per_item))
  if annotated is None:
    return
  assert T.strip_tags(annotated) == answer
  segments = T.parse(annotated)
  for i, promise in enumerate(segments):
    if not isinstance(promise, T.Promise):
      continue
    marker, block = segments[i - 1].text.splitlines()[-1], segments[i + 1].text
    items_in_block = sum(1 for kind, _ in split_items(marker + block) if kind == "item")
    assert len(promise.topic.split(", ")) == items_in_block  # the topic names each item it promises
    if per_item and all(re.match(r"\d+\. ", chunk) for kind, chunk in split_items(answer) if kind == "item"):
      assert items_in_block == 1  # by default a numbered list forks item by item
    numbers = re.findall(r"(?m)^(\d+)\. ", marker + block)
    if items_in_block > 1 and len(numbers) == items_in_block:  # a numbered group says where it ends
      assert promise.topic.startswith(f"{numbers[0]}-{numbers[-1]}: ")
  pieces = split_items(answer)
  starts = [sum(len(chunk) for _, chunk in pieces[:i]) for i in range(len(pieces) + 1)]
  spans = fork_spans(annotated)
  forked_until = 0
  for run in list_runs(pieces):
    run_spans = [(a, b) for a, b in spans if starts[run[0]] <= a < starts[run[-1] + 1]]
    assert len(run_spans) <= max_blocks
    assert all(b <= starts[run[-1]] for _, b in run_spans)  # the list's last item is main's
    forked_until = starts[run[-1] + 1] if run_spans else forked_until
  assert (T.SYNC in annotated) == bool(answer[forked_until:].strip())  # a paragraph after the lists waits


def test_annotate_records_uses_the_grouping_when_given():
  from pasta_jax.data.pipeline import annotate_records, token_counter
  from tests.tiny import CharTokenizer
  tokenizer, grouping = CharTokenizer(), Grouping(max_blocks=2, min_block_tokens=20)
  records = [{"id": "a", "instruction": "Tips?", "output": TIPS}, {"id": "b", "instruction": "Hi", "output": "Hi."}]
  annotated = annotate_records(records, tokenizer, grouping=grouping)
  assert annotated[0]["annotated"] == annotate_grouped(TIPS, token_counter(tokenizer), grouping)
  assert annotated[0]["annotated"] != annotate_records(records, tokenizer)[0]["annotated"]  # not the per-item one
  assert "annotated" not in annotated[1]  # no list: a plain answer
