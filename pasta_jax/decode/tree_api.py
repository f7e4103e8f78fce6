"""Decoding with APAR's fork pattern (and SoT's fan-out) through the one interpreter.

`generate_apar(model, prompts)` samples (or force-replays) APAR answers; `run_tree_ids` is the
general entry: any `InterpreterConfig` APAR settings, per-thread scripts optional. Results carry the
text in tree order, each thread's own text, the records, peak live KV slots and the critical path.

APAR's text form: `root<fork/><child>detail</child>next root…`, tokens FORK, CHILD and the end id.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.state import THREAD, TOKEN
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import apar_tree as tree
from pasta_jax.lang.tags import TagVocab

FORK_TAG, CHILD_OPEN, CHILD_CLOSE = "<fork/>", "<child>", "</child>"
_APAR_TAGS = re.compile(r"<fork/>|<child>|</child>")


@dataclasses.dataclass(frozen=True)
class TreeResult:
  text: str  # tree order, tags removed
  annotated: str  # APAR text form
  thread_texts: tuple[str, ...]  # each thread's own text (no tags), in thread order
  records: np.ndarray  # [N, 5]
  parents: np.ndarray  # [U]
  steps: int
  stalls: int
  finished: bool
  truncated: bool
  peak_live_slots: int  # the prompt included
  seconds: float
  content_tokens: int  # tokens of the answer without FORK / CHILD / end ids
  critical_path: int  # steps with unlimited lanes
  theoretical_speedup: float  # content_tokens / critical_path
  fork_refusals: int = 0  # forks the depth limit or a full lane table refused (counted, not silent)


def encode_apar_text(text: str, tokenizer: api.LangTokenizer, vocab: TagVocab, where: str = "",
                     end_id: int | None = None) -> list[int]:
  """APAR text form -> tree-order ids (children end with `end_id`, default the vocab's first end id;
  main's end id is not included)."""
  end = vocab.eos_ids[0] if end_id is None else end_id
  ids, depth, last = [], 0, 0
  pieces = list(_APAR_TAGS.finditer(text))
  for k, match in enumerate(pieces):
    if match.start() > last:
      ids += tokenizer.encode(text[last:match.start()])
    tag = match.group()
    if tag == FORK_TAG:
      nxt = pieces[k + 1] if k + 1 < len(pieces) else None
      if nxt is None or nxt.group() != CHILD_OPEN or nxt.start() != match.end():
        raise TagError(f"{where}character {match.start()}: <fork/> must be followed by <child>")
      ids.append(vocab.apar_fork)
    elif tag == CHILD_OPEN:
      if k == 0 or pieces[k - 1].group() != FORK_TAG or pieces[k - 1].end() != match.start():
        raise TagError(f"{where}character {match.start()}: <child> without <fork/> before it")
      ids.append(vocab.apar_child)
      depth += 1
    else:
      if depth == 0:
        raise TagError(f"{where}character {match.start()}: </child> without an open <child>")
      ids.append(end)
      depth -= 1
    last = match.end()
  if last < len(text):
    ids += tokenizer.encode(text[last:])
  if depth:
    raise TagError(f"{where}end of text: {depth} <child> block(s) never closed")
  return ids


def decode_tree(ids: Sequence[int], tokenizer: api.LangTokenizer, vocab: TagVocab) -> tuple[str, str]:
  """Tree-order ids -> (clean text, APAR text form); lenient about a cut-off end."""
  clean, annotated, chunk = [], [], []

  def flush():
    if chunk:
      piece = tokenizer.decode(chunk)
      clean.append(piece)
      annotated.append(piece)
      chunk.clear()

  depth = 0
  for t in ids:
    if t == vocab.apar_fork:
      flush()
      annotated.append(FORK_TAG)
    elif t == vocab.apar_child:
      flush()
      annotated.append(CHILD_OPEN)
      depth += 1
    elif t in vocab.eos_ids:
      flush()
      if depth:
        annotated.append(CHILD_CLOSE)
        depth -= 1
    elif t not in vocab.tag_ids:
      chunk.append(t)
  flush()
  return "".join(clean), "".join(annotated) + CHILD_CLOSE * depth


def to_tree_result(run, seconds: float, tokenizer: api.LangTokenizer, vocab: TagVocab) -> TreeResult:
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
  return TreeResult(text=text, annotated=annotated, thread_texts=tuple(tokenizer.decode(x) for x in own),
                    records=run.records, parents=run.parents, steps=run.steps, stalls=run.stalls,
                    finished=run.finished, truncated=run.truncated, peak_live_slots=run.peak_live_slots,
                    seconds=seconds, content_tokens=content, critical_path=path,
                    theoretical_speedup=content / path if path else math.nan, fork_refusals=run.fork_refusals)


def run_tree_ids(model, ids: Sequence[Sequence[int]], *, scripts=None, params=None, max_new_tokens: int = 256,
                 lanes: int = 8, max_threads: int = 64, sampling: SamplingConfig = api.GREEDY, dtype=jnp.float32,
                 max_depth: int = 3, initial_threads: int = 1, sample_after_script: bool = False) -> list[TreeResult]:
  """The interpreter in APAR mode on prompt ids; scripts[b][u] forces thread u of request b."""
  if model.tokenizer is None:
    raise PastaError("this model has no tokenizer; APAR decoding needs one for its fork tokens")
  prep = api.prepare(model, ids, params=params, max_new_tokens=max_new_tokens, lanes=lanes,
                     max_threads=max_threads, sampling=sampling, dtype=dtype, scripts=scripts, mode="apar",
                     max_depth=max_depth, initial_threads=initial_threads, sample_after_script=sample_after_script)
  runs, seconds = api.run_prepared(prep)
  lang = api.LangTokenizer(model.tokenizer)
  return [to_tree_result(r, seconds, lang, prep.vocab) for r in runs]


def generate_apar(model, prompts: list[str], *, forced_answers: list[str] | None = None, chat: bool = True,
                  lanes: int = 8, max_threads: int = 64, **kw) -> list[TreeResult]:
  """APAR-decodes each prompt; forced_answers (APAR text form) are replayed instead of sampled."""
  if model.tokenizer is None:
    raise PastaError("this model has no tokenizer; APAR decoding needs one for its fork tokens")
  ids = api.prompt_ids(model.tokenizer, prompts, chat)
  scripts = None
  if forced_answers is not None:
    if len(forced_answers) != len(ids):
      raise PastaError(f"got {len(forced_answers)} forced answers for {len(ids)} prompts")
    vocab, lang = model.tokenizer.tag_vocab(), api.LangTokenizer(model.tokenizer)
    scripts = [tree.thread_scripts(tree.parse_tree(encode_apar_text(a, lang, vocab, f"forced answer {i}: "), vocab),
                                   vocab, lanes, max_threads) for i, a in enumerate(forced_answers)]
  return run_tree_ids(model, ids, scripts=scripts, lanes=lanes, max_threads=max_threads, **kw)
