"""The one result type of every decoding method, built on the host from a run's records."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from pasta_jax.decode.apar_text import decode_tree
from pasta_jax.decode.loop import RunOutput
from pasta_jax.decode.state import LANE, STEP, THREAD, TOKEN
from pasta_jax.errors import TagError
from pasta_jax.lang import apar_tree as tree
from pasta_jax.lang import metrics, scoped
from pasta_jax.lang import text as T
from pasta_jax.lang import tokens as tok
from pasta_jax.lang.tags import TagVocab


@dataclasses.dataclass(frozen=True)
class ThreadTrace:
  """One thread of a run. Steps are interpreter steps (step 0 samples main's first token)."""

  thread: int  # 0 = main, forks numbered in spawn order
  lane: int
  spawn_step: int  # main: 0; a fork: the step its `<async>` is recorded (and fed)
  finish_step: int | None  # main: its end token's record; a fork: its `</async>` record; None if cut off
  tokens: int  # content tokens (no `<async>` / `</async>` / end id)
  fed_steps: tuple[int, ...]  # steps at which this thread fed a token (for charts)


@dataclasses.dataclass(frozen=True)
class Result:
  """One request's answer and trace, for every method (`pasta_jax.methods.generate`).

  PASTA and sequential answers are in promise form; APAR and SoT answers in APAR's text form, with
  `thread_texts` (each thread's own text) and `parents` (the thread tree)."""

  text: str  # the clean answer: tags and topics removed, blocks spliced in (APAR: tree order)
  annotated: str  # the tagged answer (rendered leniently if the run was cut off)
  records: np.ndarray  # [N, 5] (step, lane, thread, token, position)
  threads: tuple[ThreadTrace, ...]
  sync_steps: tuple[int, ...]  # steps at which main's `<sync/>` fed (PASTA)
  steps: int
  stalls: int
  finished: bool
  truncated: bool
  theoretical_speedup: float  # content tokens / critical path of the answer (nan if it is malformed)
  theoretical_parallelism: float
  seconds: float  # wall time of the run (compile excluded)
  tokens: int  # every token of the answer (tags and topics included, end id excluded)
  content_tokens: int  # the answer's text tokens: the sequential answer's token count
  pool_full: bool = False  # cut because the KV pool had no room left (see stop_reason)
  budget_spent: bool = False  # cut at the content-token budget (max_new_tokens in free decoding)
  method: str = "pasta"
  critical_path: float = math.nan  # steps with unlimited lanes
  refusals: int = 0  # most likely tokens a limit refused (what they were: `refused`)
  refused: str = "forks refused (depth limit or no free lane)"  # what a refusal is for the method that ran
  head_fallbacks: int = 0  # steps a certified head chose again from the float32 head (`certify_head`)
  peak_live_slots: int = 0  # most KV slots live at once, the prompt included
  parents: np.ndarray | None = None  # [U] the thread that spawned each thread (-1: main / none)
  thread_texts: tuple[str, ...] = ()  # each thread's own text, in thread order (APAR, SoT)
  logits: np.ndarray | None = None  # [N, V] behind each record (zeros for inserted tokens), on request
  drafts: tuple[str, ...] = ()  # Superposed Decoding: the k drafts, most probable first (`text` is the first)
  draft_scores: tuple[float, ...] = ()  # their log probabilities (n-gram smoothed)
  speculation: dict | None = None  # Medusa / ProPD: accept length, per-head hit rates, tree sizes chosen

  @property
  def stop_reason(self) -> str:
    """Why the run ended: "end" (the model finished), "tokens" (the answer reached its content-token
    budget, max_new_tokens), "pool" (the KV pool ran out of slots: it holds the budget plus a margin for
    tags, and an answer whose tags overflow that margin fills it first), or "steps" (the step budget ran
    out: forced replays, or a run that stalls)."""
    if self.finished:
      return "end"
    return "tokens" if self.budget_spent else "pool" if self.pool_full else "steps"

  @property
  def stop_note(self) -> str:
    """One line for the user when the answer was cut ("" when it ended)."""
    return {"end": "", "steps": f"cut by the step budget after {self.steps} steps: raise max_new_tokens",
            "tokens": f"cut at the content-token budget ({self.content_tokens} content tokens): raise max_new_tokens",
            "pool": f"cut when the KV pool filled ({self.tokens} tokens written by all lanes; tags and topics took "
                    "more than the pool's margin over the content budget): raise max_new_tokens, which sizes the "
                    "pool"}[self.stop_reason]


PastaResult = TreeResult = Result  # the names earlier code used


def thread_traces(records: np.ndarray, vocab: TagVocab) -> tuple[ThreadTrace, ...]:
  """Per-thread spawn/finish steps, lanes, token counts and fed steps (docs/interpreter.md, records)."""
  out = []
  for u in sorted(set(records[:, THREAD].tolist())):
    rows = records[records[:, THREAD] == u]
    toks = rows[:, TOKEN].tolist()
    if u == 0:  # main's k-th token feeds when its (k+1)-th is recorded; its end token never feeds
      fed = tuple(int(s) for s in rows[1:, STEP])
      ended = bool(toks) and toks[-1] in vocab.eos_ids
      finish = int(rows[-1, STEP]) if ended else None
      content = len(content_ids(toks, vocab))
    else:  # a fork's `<async>` feeds at its record step, every later token one step after its record
      fed = tuple(int(s) if t == vocab.async_open else int(s) + 1 for s, t in zip(rows[:, STEP], toks))
      closed = toks[-1] == vocab.async_close
      finish = int(rows[-1, STEP]) if closed else None
      content = len([t for t in toks if t not in (vocab.async_open, vocab.async_close)])
    out.append(ThreadTrace(thread=int(u), lane=int(rows[0, LANE]), spawn_step=int(rows[0, STEP]),
                           finish_step=finish, tokens=content, fed_steps=fed))
  return tuple(out)


def content_ids(ids: Sequence[int], vocab: TagVocab) -> list[int]:
  """Ids without tags, promise topics and end ids (lenient: works on cut-off answers too)."""
  content, in_topic = [], False
  for t in ids:
    in_topic = (in_topic or t == vocab.promise) and not vocab.is_length(t)
    if not in_topic and t not in vocab.tag_ids and t not in vocab.eos_ids:
      content.append(t)
  return content


def sync_steps(records: np.ndarray, vocab: TagVocab) -> tuple[int, ...]:
  main = records[records[:, THREAD] == 0]
  return tuple(int(main[k + 1, STEP]) for k in range(len(main) - 1) if main[k, TOKEN] == vocab.sync)


def ends_in_topic(ids: Sequence[int], vocab: TagVocab) -> bool:
  """Whether the answer was cut after a promise opened and before its length closed the topic."""
  in_topic = False
  for t in ids:
    in_topic = (in_topic or t == vocab.promise) and not vocab.is_length(t)
  return in_topic


def clean_text(ids: Sequence[int], annotated: str, tokenizer, vocab: TagVocab) -> str:
  """strip_tags of the annotated text; for a cut-off (malformed) answer, its content tokens decoded. An answer cut
  inside a promise's topic parses without error (the unfinished `<promise topic="...` reads as text), so it takes
  the content tokens too: neither the tag nor its topic is text."""
  if not ends_in_topic(ids, vocab):
    try:
      return T.strip_tags(annotated)
    except TagError:
      pass
  return tokenizer.decode(content_ids(ids, vocab))


def pasta_result(run: RunOutput, seconds: float, tokenizer, vocab: TagVocab, method: str = "pasta") -> Result:
  """A PASTA (or sequential) run -> its Result: annotated answer in promise form, metrics, trace."""
  ids = metrics.annotated_from_records(run.records, vocab)
  body, _ = tok.split_end(ids, vocab)
  try:
    annotated = tok.decode_answer(ids, tokenizer, vocab)
    answer = metrics.answer_metrics(ids, vocab)
    speedup, parallelism, content = answer.theoretical_speedup(), answer.theoretical_parallelism, answer.content_tokens
    path = float(answer.critical_path)
  except TagError:  # a run cut off mid-block: render what there is, each fork the cut left open closed
    annotated = tok.decode_answer(metrics.annotated_from_records(run.records, vocab, close_open=True), tokenizer,
                                  vocab, strict=False)
    speedup = parallelism = path = math.nan
    content = len(content_ids(ids, vocab))
  return Result(
      text=clean_text(ids, annotated, tokenizer, vocab), annotated=annotated, records=run.records,
      threads=thread_traces(run.records, vocab), sync_steps=sync_steps(run.records, vocab), steps=run.steps,
      stalls=run.stalls, finished=run.finished, truncated=run.truncated, theoretical_speedup=speedup,
      theoretical_parallelism=parallelism, seconds=seconds, tokens=len(body), content_tokens=content,
      pool_full=run.pool_full, budget_spent=run.budget_spent, method=method, critical_path=path,
      refusals=run.refusals, refused="topics cut at their cap (max_topic_tokens)", head_fallbacks=run.head_fallbacks,
      peak_live_slots=run.peak_live_slots, parents=run.parents, logits=run.logits)


def scoped_text_order(records: np.ndarray, parents: np.ndarray, vocab: TagVocab) -> list[int]:
  """A scoped run's tokens in text order: each thread's tokens, its k-th fed `<promise/>` followed by its k-th
  child's tokens (`<async>` ... `</async>`), recursively; main's end id last (lenient: works on cut-off runs)."""
  own = {int(u): records[records[:, THREAD] == u, TOKEN].tolist() for u in np.unique(records[:, THREAD])}
  children = {u: [v for v in sorted(own) if v > 0 and int(parents[v]) == u] for u in own}

  def walk(u: int) -> list[int]:
    out, kids = [], iter(children[u])
    for token in own[u]:
      out.append(token)
      if token == vocab.bare_promise:
        child = next(kids, None)
        out += walk(child) if child is not None else []
    return out

  return walk(0)


def scoped_result(run: RunOutput, seconds: float, tokenizer, vocab: TagVocab, method: str = "pasta-v0") -> Result:
  """A scoped (earlier-paper) run -> its Result: the annotated answer in the scoped text form, the clean text
  (each `<promise/>` replaced by its block: the text order without tags), metrics and trace."""
  ids = scoped_text_order(run.records, run.parents, vocab)
  body = [t for t in ids if t not in vocab.eos_ids]
  content = [t for t in body if t not in vocab.tag_ids]
  try:
    path = float(scoped.critical_path(scoped.parse_tokens(body, vocab), vocab))
    speedup = len(content) / path if path else math.nan
  except TagError:  # cut off mid-block or mid-scope
    path = speedup = math.nan
  return Result(
      text=tokenizer.decode(content), annotated=scoped.decode(body, tokenizer.decode, vocab), records=run.records,
      threads=thread_traces(run.records, vocab), sync_steps=(), steps=run.steps, stalls=run.stalls,
      finished=run.finished, truncated=run.truncated, theoretical_speedup=speedup, theoretical_parallelism=speedup,
      seconds=seconds, tokens=len(body), content_tokens=len(content), pool_full=run.pool_full,
      budget_spent=run.budget_spent, method=method, critical_path=path, refusals=run.refusals,
      head_fallbacks=run.head_fallbacks,
      peak_live_slots=run.peak_live_slots, parents=run.parents, logits=run.logits)


def drafts_result(run: RunOutput, seconds: float, tokenizer, vocab: TagVocab, method: str = "superposed") -> Result:
  """A Superposed Decoding run -> its Result: `text` is the most probable draft, `drafts` all k. The
  records are the lane's feed (each step's best alive token), kept for the trace and the step counts. A run
  that did not settle stopped at the drafts' length (max_new_tokens): its stop reason is "tokens"."""
  base = pasta_result(run, seconds, tokenizer, vocab, method)
  out = run.rule_outputs
  drafts = tuple(tokenizer.decode(ids) for ids in out["draft_tokens"])
  best = drafts[0] if drafts else ""
  return dataclasses.replace(base, text=best, annotated=best, drafts=drafts,
                             draft_scores=tuple(out["draft_scores"]), budget_spent=not run.finished,
                             content_tokens=len(out["draft_tokens"][0]) if drafts else 0)


def tree_result(run: RunOutput, seconds: float, tokenizer, vocab: TagVocab, method: str = "apar") -> Result:
  """An APAR (or SoT) run -> its Result: text in tree order, APAR text form, per-thread texts."""
  ids = tree.tree_order(run.records, run.parents, vocab)
  text, annotated = decode_tree(ids, tokenizer, vocab)
  threads = sorted(set(run.records[:, THREAD].tolist()))
  own = [[t for t in run.records[run.records[:, THREAD] == u, TOKEN].tolist() if t not in vocab.tag_ids
          and t not in vocab.eos_ids] for u in threads]
  content = sum(len(x) for x in own)
  try:
    path = tree.critical_path(tree.parse_tree(ids, vocab), vocab)
  except TagError:
    path = 0
  return Result(
      text=text, annotated=annotated, records=run.records, threads=(), sync_steps=(), steps=run.steps,
      stalls=run.stalls, finished=run.finished, truncated=run.truncated,
      theoretical_speedup=content / path if path else math.nan,
      theoretical_parallelism=content / path if path else math.nan, seconds=seconds,
      tokens=len([t for t in ids if t not in vocab.eos_ids]), content_tokens=content, pool_full=run.pool_full,
      budget_spent=run.budget_spent, method=method, critical_path=float(path) if path else math.nan,
      refusals=run.refusals, head_fallbacks=run.head_fallbacks, peak_live_slots=run.peak_live_slots,
      parents=run.parents,
      thread_texts=tuple(tokenizer.decode(x) for x in own), logits=run.logits)
