"""Each thread's own text (`decode.thread_text`) and the `pasta_threads` events built from it (`serve.shapes`).

Runs are PASTA records built here (main's ids with promises, each LENGTH forking a block recorded a step later, one
token a step, closed or cut off) and drawn by hypothesis. The threads' texts together are the composed answer's
content: every fork's text is its block in the answer, and main's is the rest. While a run goes on, each thread's
text only grows: it is a prefix of the thread's final text wherever the run is cut (a detokenizer with byte pieces
included), and the events a stream sends rebuild every thread's text and steps exactly."""

from __future__ import annotations

import collections
import functools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.loop import RunOutput
from pasta_jax.decode.result import pasta_result
from pasta_jax.decode.state import STEP, THREAD
from pasta_jax.decode.thread_text import thread_texts
from pasta_jax.serve.shapes import ThreadEvents
from tests.tiny import BYTE_BASE, TEXT_BASE, BytePieces, CharTokenizer

VOCAB = CharTokenizer().tag_vocab()
EOS = VOCAB.eos_ids[0]



CHARS = [TEXT_BASE + ord(c) for c in "abcdefgh XYZ\n"]
BYTES = [BYTE_BASE + b for b in (0xC3, 0xA9, 0xE2, 0x82, 0xAC)]  # é = C3 A9, € = E2 82 AC
TEXT = st.lists(st.sampled_from(CHARS), min_size=1, max_size=5)
TOPIC = st.lists(st.sampled_from([TEXT_BASE + ord(c) for c in "topic"]), max_size=3)
PROMISE = st.builds(lambda topic, length: [VOCAB.promise, *topic, length], TOPIC, st.sampled_from(VOCAB.lengths[:3]))


@st.composite
def pasta_runs(draw, pieces=TEXT, block=TEXT) -> np.ndarray:
  """Records of a PASTA run: main's text, promises and `<sync/>`s, then its end (or cut off); the fork of main's
  k-th LENGTH records `<async>` in the step after the LENGTH's, then one token a step, closed with `</async>` or cut
  off (the run cut with it)."""
  main: list[int] = []
  for kind in draw(st.lists(st.sampled_from(["text", "promise", "sync"]), max_size=7)):
    main += draw(pieces) if kind == "text" else draw(PROMISE) if kind == "promise" else [VOCAB.sync]
  ended = draw(st.booleans())
  main += [EOS] if ended else []
  rows, fork = [], 0
  for step, token in enumerate(main):
    rows.append((step, 0, 0, token))
    if VOCAB.is_length(token) and step + 1 < len(main):
      fork += 1
      closed = ended or draw(st.booleans())
      for at, t in enumerate([VOCAB.async_open, *draw(block)] + ([VOCAB.async_close] if closed else []), step + 1):
        rows.append((at, fork, fork, t))
  if not rows:
    rows = [(0, 0, 0, CHARS[0])]
  rows.sort(key=lambda r: r[0])
  return np.asarray([(s, lane, u, t, i) for i, (s, lane, u, t) in enumerate(rows)], np.int32)


def result_of(records: np.ndarray, tokenizer):
  main = records[records[:, THREAD] == 0, 3]
  finished = bool(len(main) and main[-1] == EOS)
  run = RunOutput(records, None, int(records[:, STEP].max()) + 1, 0, finished, not finished)
  return pasta_result(run, 0.0, tokenizer, VOCAB)


def spliced(answer: str, main: str, blocks: list[str]) -> bool:
  """Whether `answer` is `main`'s text with each of `blocks` inserted whole somewhere, in order."""
  @functools.cache
  def fits(at: int, in_main: int, block: int) -> bool:
    if at == len(answer):
      return in_main == len(main) and all(not b for b in blocks[block:])
    if in_main < len(main) and answer[at] == main[in_main] and fits(at + 1, in_main + 1, block):
      return True
    return block < len(blocks) and answer.startswith(blocks[block], at) and (
        fits(at + len(blocks[block]), in_main, block + 1) if blocks[block] else fits(at, in_main, block + 1))
  return fits(0, 0, 0)


def parents_of(records: np.ndarray) -> np.ndarray:
  threads = int(records[:, THREAD].max()) + 1
  return np.asarray([-1] + [0] * (threads - 1))


@settings(max_examples=300, deadline=None)
@given(records=pasta_runs())
def test_the_threads_texts_together_are_the_composed_answers_content(records):
  tokenizer = CharTokenizer()
  result = result_of(records, tokenizer)
  threads = thread_texts(records, tokenizer, VOCAB, parents_of(records), final=True)
  assert collections.Counter("".join(t.text for t in threads)) == collections.Counter(result.text)
  main, *forks = threads
  assert main.thread == 0 and main.parent is None and all(f.parent == 0 for f in forks)
  assert spliced(result.text, main.text, [f.text for f in forks])  # each fork's block lands whole, in fork order
  assert all(t.done for t in threads)
  assert sum(len(t.steps) for t in threads) == len(records)


@settings(max_examples=300, deadline=None)
@given(records=pasta_runs(pieces=st.lists(st.sampled_from(CHARS + BYTES), min_size=1, max_size=5),
                          block=st.lists(st.sampled_from(CHARS + BYTES), min_size=1, max_size=6)),
       data=st.data())
def test_a_threads_text_only_grows_and_the_events_rebuild_it(records, data):
  """Cut after any steps, as a server's chunks cut a run: every thread's settled text extends the one before and is
  a prefix of its final text, and the events sent after each cut rebuild each thread's final text and steps."""
  tokenizer = BytePieces()
  steps = sorted(set(records[:, STEP].tolist()))
  cuts = sorted(set(data.draw(st.lists(st.sampled_from(steps)), label="chunk ends")))
  final = {t.thread: t for t in thread_texts(records, tokenizer, VOCAB, parents_of(records), final=True)}
  events, shown = ThreadEvents(), {}
  seen: dict[int, str] = {}
  for cut in cuts + [None]:
    part = records if cut is None else records[records[:, STEP] <= cut]
    threads = thread_texts(part, tokenizer, VOCAB, parents_of(records), final=cut is None)
    for thread in threads:
      assert final[thread.thread].text.startswith(thread.text), (cut, thread)
      assert thread.text.startswith(seen.get(thread.thread, "")), (cut, thread)
      seen[thread.thread] = thread.text
    for event in events.events(threads):
      assert not event.get("reset")  # no seam: each text extends the last
      text, steps = shown.get(event["thread"], ("", set()))
      shown[event["thread"]] = (text + event["text"], steps | set(event["steps"]))
  assert {u: t for u, (t, _) in shown.items()} == {u: t.text for u, t in final.items()}
  assert {u: s for u, (_, s) in shown.items()} == {u: set(t.steps) for u, t in final.items()}


def test_a_thread_still_writing_holds_back_its_last_token_and_hides_an_open_topic():
  tokenizer = CharTokenizer()
  text = lambda s: [TEXT_BASE + ord(c) for c in s]
  main = [*text("Hi"), VOCAB.promise, *text("to")]  # the topic is not text, written or not
  records = np.asarray([(s, 0, 0, t, s) for s, t in enumerate(main)], np.int32)
  [writing] = thread_texts(records, tokenizer, VOCAB, final=False)
  assert writing.text == "Hi" and not writing.done and writing.steps == (0, 1, 2, 3, 4)
  records = np.asarray([(s, 0, 0, t, s) for s, t in enumerate(text("Hello"))], np.int32)
  assert thread_texts(records, tokenizer, VOCAB, final=False)[0].text == "Hell"  # "o" may yet join the next id
  assert thread_texts(records, tokenizer, VOCAB, final=True)[0].text == "Hello"


def test_forced_tokens_are_not_what_a_thread_wrote_and_a_thread_of_only_forced_ones_is_left_out():
  """SoT's expansions: each thread is forced through its point prompt; a spare thread writes nothing of its own."""
  tokenizer = CharTokenizer()
  text = lambda s: [TEXT_BASE + ord(c) for c in s]
  rows = [(0, 0, 0, t) for t in text("P1:") + text(" tea") + [EOS]] + [(0, 1, 1, t) for t in text("P2:") + text(" go")]
  rows += [(0, 2, 2, EOS), (1, 2, 2, EOS)]
  records = np.asarray([(i, lane, u, t, i) for i, (_, lane, u, t) in enumerate(rows)], np.int32)
  threads = thread_texts(records, tokenizer, VOCAB, np.asarray([-1, -1, -1]), final=False, forced=[3, 3, 2])
  assert [(t.thread, t.parent, t.text, t.done) for t in threads] == [(0, None, " tea", True), (1, None, " g", False)]


def test_a_text_that_stops_extending_what_was_sent_is_sent_whole_with_reset():
  from pasta_jax.decode.thread_text import ThreadText
  events = ThreadEvents()
  first = events.events((ThreadText(0, None, "ab", (0, 1), False),))
  assert first == [{"thread": 0, "parent": None, "text": "ab", "steps": [0, 1], "done": False}]
  assert events.events((ThreadText(0, None, "ab", (0, 1), False),)) == []  # nothing moved: no event
  again = events.events((ThreadText(0, None, "aB!", (0, 1, 2), True),))
  assert again == [{"thread": 0, "parent": None, "text": "aB!", "steps": [2], "done": True, "reset": True}]
