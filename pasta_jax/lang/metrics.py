"""Critical path and speed metrics of annotated answers and of interpreter traces.

Critical path: the number of decode steps (steps 1, 2, ... in which some lane feeds a token; step 0
only samples the first token from the prefill) the interpreter needs for the answer with unlimited
lanes and thread ids, under docs/interpreter.md's step semantics:
  - main feeds one token per step; main's n-th answer token is fed at step n unless it waited;
  - a promise's LENGTH token fed at step t spawns its fork in the same step: `<async>` is fed at
    t, content token j at t + j, and the fork's `</async>` (the closing step) at t + n + 1;
  - a `<sync/>` (and main's end, the implicit final sync) waits while a fork is running: it feeds
    at max(its own turn, the latest closing step of the forks spawned so far) (a closing fork does
    not hold main back, so `<sync/>` and the last `</async>` feed in the same step);
  - the answer's final end id is sampled but never fed; the request ends at the last feed.
A tag-free answer of n tokens has critical path n, the same count as sequential decoding.

Baseline tokens (default): the answer's content tokens in sequential order: main text plus block
contents, without tags, topics or the end id (`tokens.strip_token_ids`). The paper's Baseline-SFT
comparison passes the length of the baseline model's own response instead.
  theoretical speedup     = baseline tokens / critical path
  theoretical parallelism = non-control tokens / critical path
Non-control tokens are those same content tokens (tags, topic tokens and end ids are control), so
with the default baseline the two coincide; they differ once a real baseline length is given.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from pasta_jax.lang.schema import LANE, POSITION, STEP, THREAD, TOKEN  # noqa: F401 (record columns, re-exported)
from pasta_jax.lang.tags import LENGTH_STEP, TagVocab
from pasta_jax.lang.tokens import TokBlock, TokPromise, TokSync, TokText, parse_tokens, split_end


@dataclasses.dataclass(frozen=True)
class AnswerMetrics:
  critical_path: int  # decode steps with unlimited lanes
  content_tokens: int  # non-control tokens (= default baseline tokens)
  answer_tokens: int  # every token of the annotated answer (tags and topics included; no end id)
  num_blocks: int

  def theoretical_speedup(self, baseline_tokens: int | None = None) -> float:
    baseline = self.content_tokens if baseline_tokens is None else baseline_tokens
    return baseline / max(self.critical_path, 1)  # an empty answer (0 steps) counts as 1 step

  @property
  def theoretical_parallelism(self) -> float:
    return self.content_tokens / max(self.critical_path, 1)


def feed_steps(ids: Sequence[int], vocab: TagVocab) -> tuple[list[int], int]:
  """(the step at which each answer token is fed under unlimited lanes, the critical path).

  ids: the annotated answer (an end id at the end is allowed and not counted).
  """
  answer, _ = split_end(ids, vocab)
  segments = parse_tokens(answer, vocab)
  steps = [0] * len(answer)
  t, closes, last_close = 0, [], 0  # t: step main last fed at; closes: closing steps of unsynced forks
  for k, seg in enumerate(segments):
    if isinstance(seg, TokBlock):
      continue  # scheduled with its promise
    if isinstance(seg, TokSync):
      t = max([t + 1] + closes)
      closes = []
      steps[seg.start] = t
      continue
    for offset in range(len(seg.all_ids)):
      t += 1
      steps[seg.start + offset] = t
    if isinstance(seg, TokPromise):
      block = segments[k + 1]
      for offset in range(len(block.all_ids)):  # <async> feeds in the spawn step t
        steps[block.start + offset] = t + offset
      closes.append(t + len(block.content) + 1)
      last_close = max(last_close, closes[-1])
  return steps, max(t, last_close)


def critical_path(ids: Sequence[int], vocab: TagVocab) -> int:
  return feed_steps(ids, vocab)[1]


def answer_metrics(ids: Sequence[int], vocab: TagVocab) -> AnswerMetrics:
  answer, _ = split_end(ids, vocab)
  segments = parse_tokens(answer, vocab)
  content = sum(len(s.ids) for s in segments if isinstance(s, TokText))
  content += sum(len(s.content) for s in segments if isinstance(s, TokBlock))
  return AnswerMetrics(critical_path=critical_path(answer, vocab), content_tokens=content,
                       answer_tokens=len(answer), num_blocks=sum(isinstance(s, TokBlock) for s in segments))


def theoretical_speedup(ids: Sequence[int], vocab: TagVocab, baseline_tokens: int | None = None) -> float:
  return answer_metrics(ids, vocab).theoretical_speedup(baseline_tokens)


def theoretical_parallelism(ids: Sequence[int], vocab: TagVocab) -> float:
  return answer_metrics(ids, vocab).theoretical_parallelism


# --- interpreter traces ------------------------------------------------------------------------------
def annotated_from_records(records: np.ndarray, vocab: TagVocab, close_open: bool = False) -> list[int]:
  """[N, 5] records -> the annotated answer: main's tokens (its final end id included) with each
  fork's tokens (`<async>` ... `</async>`) spliced right after the LENGTH token that spawned it.
  close_open: a fork a cut left open gets its `</async>` (the budget cut it, not the model).

  Fork thread u was spawned by main's u-th LENGTH token (threads are numbered in spawn order).
  """
  records = np.asarray(records)
  by_thread: dict[int, list[int]] = {}
  for row in records:
    by_thread.setdefault(int(row[THREAD]), []).append(int(row[TOKEN]))
  out, fork = [], 0
  for token in by_thread.get(0, []):
    out.append(token)
    if vocab.is_length(token):
      fork += 1
      block = by_thread.get(fork, [])
      out += block
      if close_open and block and block[-1] != vocab.async_close:
        out.append(vocab.async_close)
  return out


def trace_steps(records: np.ndarray, vocab: TagVocab) -> int:
  """Steps a finished request ran (its last feed), from its records alone.

  Main's k-th token is fed at the step its (k+1)-th token is recorded; a fork's `<async>` is fed
  at the step it is recorded and every other fork token one step after its record.
  """
  records = np.asarray(records)
  main = records[records[:, THREAD] == 0]
  last = int(main[-1, STEP]) if len(main) > 1 else 0
  forks = records[records[:, THREAD] > 0]
  fed = np.where(forks[:, TOKEN] == vocab.async_open, forks[:, STEP], forks[:, STEP] + 1)
  return max([last] + fed.tolist())


@dataclasses.dataclass(frozen=True)
class TraceMetrics:
  answer: AnswerMetrics  # of the annotated answer the trace produced (unlimited lanes)
  steps: int  # steps the interpreter actually ran (finite lanes: stalls make it longer)

  def realized_step_speedup(self, baseline_tokens: int | None = None) -> float:
    baseline = self.answer.content_tokens if baseline_tokens is None else baseline_tokens
    return baseline / max(self.steps, 1)


def trace_metrics(records: np.ndarray, vocab: TagVocab, steps: int | None = None) -> TraceMetrics:
  """Metrics of one finished request's trace; `steps` defaults to `trace_steps(records)`."""
  answer = annotated_from_records(records, vocab)
  return TraceMetrics(answer=answer_metrics(answer, vocab),
                      steps=trace_steps(records, vocab) if steps is None else steps)


# --- aggregation -------------------------------------------------------------------------------------
def geometric_mean(values: Iterable[float]) -> float:
  """Geometric mean of positive values (the papers' aggregate for speedups); nan if empty."""
  values = [float(v) for v in values]
  if not values:
    return math.nan
  if min(values) <= 0:
    raise ValueError(f"geometric mean needs positive values, got {min(values)}")
  return math.exp(sum(math.log(v) for v in values) / len(values))


def arithmetic_mean(values: Iterable[float]) -> float:
  values = [float(v) for v in values]
  return sum(values) / len(values) if values else math.nan



# --- duplicate blocks ----------------------------------------------------------------------------------
WORDS = re.compile(r"\w+")
DUPLICATE_NGRAM = 4
DUPLICATE_OVERLAP = 0.5


def word_ngrams(text: str, n: int = DUPLICATE_NGRAM) -> set[tuple[str, ...]]:
  """Lower-cased word n-grams; a text shorter than n words is its one whole-text gram (so two equal
  short blocks still count as duplicates)."""
  words = WORDS.findall(text.lower())
  if len(words) < n:
    return {tuple(words)} if words else set()
  return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def ngram_overlap(a: str, b: str, n: int = DUPLICATE_NGRAM) -> float:
  """|shared n-grams| / |n-grams of the shorter one| (0 when either has none)."""
  ga, gb = word_ngrams(a, n), word_ngrams(b, n)
  if not ga or not gb:
    return 0.0
  return len(ga & gb) / min(len(ga), len(gb))


def block_texts(annotated: str, length_step: int = LENGTH_STEP) -> list[str] | None:
  """The block texts of a promise-form answer, or None if it does not parse strictly (promise lengths in multiples of
  `length_step`: 1 for a Pred-1x model's answers, `schema.length_step`)."""
  parsed = block_spans(annotated, length_step)
  return None if parsed is None else [parsed[0][lo:hi] for lo, hi in parsed[1]]


def block_spans(annotated: str, length_step: int = LENGTH_STEP) -> tuple[str, list[tuple[int, int]]] | None:
  """(the clean answer, [start, end) character span of each block in it), or None if the answer does not parse
  strictly: where in the text a sequential reader meets each fork's block."""
  from pasta_jax.errors import TagError
  from pasta_jax.lang import text as T
  try:
    segments = T.parse(annotated, length_step)
    T.check_segments(segments, length_step)
  except TagError:
    return None
  clean, spans = "", []
  for segment in segments:
    if isinstance(segment, T.Block):
      spans.append((len(clean), len(clean) + len(segment.text)))
    if isinstance(segment, (T.Text, T.Block)):
      clean += segment.text
  return clean, spans


def duplicate_block_pairs(blocks: Sequence[str], n: int = DUPLICATE_NGRAM,
                          threshold: float = DUPLICATE_OVERLAP) -> tuple[int, int]:
  """(sibling pairs whose word n-gram overlap exceeds `threshold`, all sibling pairs) of one answer's
  block texts. Blocks are siblings in the default (non-nested) language: every pair counts."""
  pairs = [(i, j) for i in range(len(blocks)) for j in range(i + 1, len(blocks))]
  dupes = sum(ngram_overlap(blocks[i], blocks[j], n) > threshold for i, j in pairs)
  return dupes, len(pairs)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
  """Length of the longest common subsequence (dynamic programming, O(len(a) len(b)))."""
  if not a or not b:
    return 0
  prev = [0] * (len(b) + 1)
  for x in a:
    cur = [0]
    for j, y in enumerate(b):
      cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
    prev = cur
  return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
  """ROUGE-L F1 over lower-cased word tokens (0 when either side is empty)."""
  cand, ref = WORDS.findall(candidate.lower()), WORDS.findall(reference.lower())
  lcs = lcs_length(cand, ref)
  if lcs == 0:
    return 0.0
  precision, recall = lcs / len(cand), lcs / len(ref)
  return 2 * precision * recall / (precision + recall)
