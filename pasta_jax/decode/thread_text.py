"""Each thread's own text in a run's records: what that thread wrote, tags hidden, for showing threads side by side.

A thread's text is its content ids (no tags, no promise topics, no end ids) decoded in the runs `streaming.text_runs`
cuts them into, one run at a time, as the promise form decodes the composed answer (`result.clean_text`). Every
thread's text lands somewhere in the composed answer: PASTA's main thread writes the text around the promises and
each fork writes one promise's block, so the threads' texts together are the answer's content.

While a run goes on, a thread's text is what of it has settled, a prefix of what the thread's text will be: the last
content id of a thread that is still writing is held back (a subword detokenizer may merge it with the next one),
and so are trailing ids that alone decode to a partial character (the next byte piece may complete it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pasta_jax.decode.state import STEP, THREAD, TOKEN
from pasta_jax.decode.streaming import text_runs
from pasta_jax.lang.tags import TagVocab

PARTIAL = "\ufffd"  # what a lone byte piece of a longer character decodes to


@dataclasses.dataclass(frozen=True)
class ThreadText:
  """One thread of a run: its own text so far and the steps at which it wrote."""

  thread: int  # 0: main (SoT: the first point), forks numbered in spawn order
  parent: int | None  # the thread that spawned it (None: main, or a method that keeps no thread tree)
  text: str  # what it wrote, tags and topics hidden (while it writes: the settled part)
  steps: tuple[int, ...]  # the step of each token it wrote (tags included), in order
  done: bool  # it wrote its end (`</async>` or an end id), or the run ended: its text is whole


def thread_texts(records: np.ndarray, tokenizer, vocab: TagVocab, parents: np.ndarray | None = None, *,
                 final: bool, forced: Sequence[int] = ()) -> tuple[ThreadText, ...]:
  """Every thread of `records` ([N, 5] rows of step, lane, thread, token, position) that wrote anything, in thread
  order. `final`: the run has ended (nothing is held back). `forced[u]`: how many of thread u's first tokens a
  script forced (SoT's point prompts): they are the prompt, not what the thread wrote. A thread all of whose tokens
  were forced (SoT's spare threads) is left out."""
  records = np.asarray(records)
  out = []
  for thread in sorted(set(records[:, THREAD].tolist())):
    rows = records[records[:, THREAD] == thread]
    skip = forced[thread] if thread < len(forced) else 0
    tokens, steps = rows[skip:, TOKEN].tolist(), rows[skip:, STEP].tolist()
    if not tokens:
      continue
    done = final or tokens[-1] in vocab.eos_ids or tokens[-1] == vocab.async_close
    out.append(ThreadText(thread=int(thread), parent=_parent(parents, thread), text=own_text(tokens, tokenizer, vocab,
                                                                                               settled=not done),
                          steps=tuple(int(s) for s in steps), done=done))
  return tuple(out)


def own_text(tokens: Sequence[int], tokenizer, vocab: TagVocab, settled: bool) -> str:
  """The text of one thread's tokens; `settled`: only what more tokens cannot change (see the module's doc)."""
  runs = [list(run) for run in text_runs(tokens, vocab)]
  if settled and runs and _ends_in_text(tokens, vocab):  # its last run is still open: the next id may join it
    last = runs[-1]
    last.pop()
    while last and PARTIAL in tokenizer.decode(last[-1:]):
      last.pop()
    if not last:
      runs.pop()
  return "".join(tokenizer.decode(run) for run in runs)


def _ends_in_text(tokens: Sequence[int], vocab: TagVocab) -> bool:
  """Whether the last token is content: not a tag, not an end id, not inside a promise's topic."""
  in_topic = False
  for t in tokens:
    in_topic = (in_topic or t == vocab.promise) and not vocab.is_length(t)
  last = tokens[-1]
  return not in_topic and last not in vocab.tag_ids and last not in vocab.eos_ids


def _parent(parents: np.ndarray | None, thread: int) -> int | None:
  if parents is None or thread >= len(parents) or int(parents[thread]) < 0:
    return None
  return int(parents[thread])
