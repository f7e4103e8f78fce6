"""The grouped structural annotator: a list forks as a few long blocks of consecutive items, not one per item.

Why: a fork pays only for a long block. On the 270M a promise costs main its topic and tags, and every live
thread adds a row to each step, so forking every short item gave 92% forking answers at 1.00x
(docs/results/archive/learned24_every_item_rp11/), and forking only long items (`structural.annotate` with
`min_saving`) forked too few answers (26%). Grouping keeps both: nearly every list forks, and each fork writes
enough to pay for its promise.

  - each list (items with only blank lines between them) is cut into g contiguous groups of nearly equal
    token counts, g = min(max_blocks + 1, its items, its tokens // min_block_tokens), lowered until every
    forked group saves main at least `min_saving` tokens (a list of names, whose topics would be its
    text, stays in main); a list with g < 2 stays plain;
  - the first g - 1 groups fork: the first item's marker stays in main (main numbers the groups), the
    promise's topic names every item of the group by its heading (`structural.topic_of`, 3 words each), so
    the fork knows how many items to write and which, and its siblings know what is taken; a numbered
    group's topic starts with its numbers ("3-4: Move, Rest"), so main's next marker is the last one + 1;
  - but by default a numbered list forks item by item (each of its first max_blocks items that saves main
    `min_saving` tokens, never its last): main then writes every marker itself and never counts;
  - the last group stays in main, after the promises: main writes it while the forks write theirs (with
    one group per item instead, main would only wait);
  - a `<sync/>` goes before the first paragraph after the last forked list (it may sum the list up);
  - every character stays where it was: `strip_tags(annotate_grouped(a)) == a` byte for byte.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence

from pasta_jax.data.structural import MARKER, PROMISE_COST, split_items, topic_of
from pasta_jax.errors import ConfigError, TagError
from pasta_jax.lang import text as T
from pasta_jax.lang.tags import round_length

Pieces = list[tuple[str, str]]  # ('text' | 'item', chunk), as `structural.split_items` returns them


@dataclasses.dataclass(frozen=True)
class Grouping:
  max_blocks: int = 3  # forks per list; its last group stays in main
  min_block_tokens: int = 24  # a list forks into at most its tokens // this many groups
  heading_words: int = 3  # words of each item's heading in its group's topic: each one costs main a step
  min_saving: int = 0  # tokens a forked group must save main (its text minus its topic and promise); 0: any
  # numbered lists fork item by item (main writes every marker, so it never counts; a model trained on
  # numbered groups misnumbered 7 of 15 lists even with the numbers in the topics)
  numbered_per_item: bool = True

  def __post_init__(self):
    if self.max_blocks < 1 or self.min_block_tokens < 1 or self.heading_words < 1:
      raise ConfigError(f"Grouping needs max_blocks, min_block_tokens and heading_words >= 1, got {self}")


def list_runs(pieces: Pieces) -> list[list[int]]:
  """The item indices of each list: items with nothing but blank text between them."""
  runs: list[list[int]] = []
  open_run = False
  for i, (kind, chunk) in enumerate(pieces):
    if kind == "item":
      if open_run:
        runs[-1].append(i)
      else:
        runs.append([i])
      open_run = True
    elif chunk.strip():
      open_run = False
  return runs


def balanced_cuts(sizes: Sequence[int], groups: int) -> list[int]:
  """Start positions of min(groups, len(sizes)) contiguous groups of `sizes`: cut k goes where the running
  total comes nearest k x total / groups, leaving every group at least one item."""
  prefix = [0, *itertools.accumulate(sizes)]
  groups = min(groups, len(sizes))
  starts = [0]
  for k in range(1, groups):
    target = k * prefix[-1] / groups
    candidates = range(starts[-1] + 1, len(sizes) - (groups - k) + 1)
    starts.append(min(candidates, key=lambda j: abs(prefix[j] - target)))
  return starts


NUMBER = re.compile(r"^[ \t]*(\d{1,3})[.)]")


def group_topic(items: Sequence[str], heading_words: int) -> str:
  """Each item's heading; a numbered group of several items starts with its numbers ("3-4: Move, Rest"), so
  main reads the next marker off the topic instead of counting headings (without it, a model trained here
  misnumbered 12 of 14 numbered lists)."""
  headings = ", ".join(topic_of(item, heading_words) for item in items)
  first, last = NUMBER.match(items[0]), NUMBER.match(items[-1])
  if len(items) < 2 or not (first and last):
    return headings
  return f"{first.group(1)}-{last.group(1)}: {headings}"


def _group_starts(pieces: Pieces, run: list[int], count_tokens: Callable[[str], int],
                  grouping: Grouping) -> list[int]:
  """Where the list's groups start (positions in `run`): the most groups whose every forked one saves main
  at least `min_saving` tokens (its text minus its topic and PROMISE_COST); [0] if none does."""
  sizes = [count_tokens(pieces[i][1]) for i in run]
  most = min(grouping.max_blocks + 1, len(run), sum(sizes) // grouping.min_block_tokens)
  for groups in range(most, 1, -1):
    starts = balanced_cuts(sizes, groups)
    bounds = [*starts, len(run)]
    savings = [_saving([pieces[i][1] for i in run[lo:hi]], count_tokens, grouping)
               for lo, hi in zip(bounds[:-2], bounds[1:-1])]  # the forked groups: all but the last
    if grouping.min_saving <= 0 or min(savings) >= grouping.min_saving:
      return starts
  return [0]


def _saving(items: Sequence[str], count_tokens: Callable[[str], int], grouping: Grouping) -> int:
  return sum(count_tokens(item) for item in items) - count_tokens(group_topic(items, grouping.heading_words)) \
      - PROMISE_COST


def _item_plan(pieces: Pieces, run: list[int], count_tokens: Callable[[str], int],
               grouping: Grouping) -> list[tuple[int, int, bool]]:
  """A numbered list: each of its first max_blocks items that saves main `min_saving` tokens forks alone."""
  plan, forks = [], 0
  for j, i in enumerate(run):
    fork = (j < len(run) - 1 and forks < grouping.max_blocks
            and (grouping.min_saving <= 0 or _saving([pieces[i][1]], count_tokens, grouping) >= grouping.min_saving))
    forks += fork
    plan.append((j, j + 1, fork))
  return plan


def _plan(pieces: Pieces, run: list[int], count_tokens: Callable[[str], int],
          grouping: Grouping) -> list[tuple[int, int, bool]]:
  """The list's groups as (start, end, forks) over positions in `run`."""
  if grouping.numbered_per_item and all(NUMBER.match(pieces[i][1]) for i in run):
    return _item_plan(pieces, run, count_tokens, grouping)
  starts = _group_starts(pieces, run, count_tokens, grouping)
  bounds = [*starts, len(run)]
  return [(lo, hi, k < len(starts) - 1) for k, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def _run_segments(pieces: Pieces, run: list[int], count_tokens: Callable[[str], int],
                  grouping: Grouping) -> list[T.Segment] | None:
  """One list's segments with its planned groups forked, or None if none is."""
  plan = _plan(pieces, run, count_tokens, grouping)
  if not any(fork for _, _, fork in plan):
    return None
  segments: list[T.Segment] = []
  for lo, hi, fork in plan:
    first, last = run[lo], run[hi - 1]
    if lo > 0:  # blank lines between groups stay in main
      segments += [T.Text(pieces[i][1]) for i in range(run[lo - 1] + 1, first)]
    chunk = "".join(pieces[i][1] for i in range(first, last + 1))
    if not fork:
      segments.append(T.Text(chunk))  # main writes it (a list's last group: while the forks write theirs)
      continue
    marker = MARKER.match(chunk).end()
    topic = group_topic([pieces[i][1] for i in run[lo:hi]], grouping.heading_words)
    segments += [T.Text(chunk[:marker]), T.Promise(topic, round_length(count_tokens(chunk[marker:]))),
                 T.Block((T.Text(chunk[marker:]),))]
  return segments


def annotate_grouped(answer: str, count_tokens: Callable[[str], int],
                     grouping: Grouping = Grouping()) -> str | None:
  """The promise-form annotation of `answer` (see module doc), or None if no list of it forks."""
  pieces = split_items(answer)
  segments: list[T.Segment] = []
  done = 0
  for run in list_runs(pieces):
    forked = _run_segments(pieces, run, count_tokens, grouping)
    if forked is None:
      continue
    segments += [T.Text(chunk) for _, chunk in pieces[done:run[0]]]
    segments += forked
    done = run[-1] + 1
  if done == 0:
    return None
  synced = False
  for _, chunk in pieces[done:]:  # everything after the last forked list
    if not synced and chunk.strip():
      segments.append(T.Sync())  # the first paragraph after it may sum it up: it waits for the blocks
      synced = True
    segments.append(T.Text(chunk))
  try:
    return T.render(T.normalize(segments))
  except TagError:  # the answer's own text spells a tag: no honest annotation
    return None

