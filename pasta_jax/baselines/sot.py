"""Skeleton-of-Thought (SoT) and SoT with a router, on the one interpreter.

Stage 1 asks the model for a short numbered outline (our skeleton prompt) and decodes it on one
lane. Its points are read by regex; with fewer than `min_points` there is no skeleton and the
prompt is answered by normal decoding instead. Stage 2 expands every point in its own lane of one
interpreter run (APAR mode's fan-out, no forks): all lanes share the prompt-and-skeleton prefix in
the pool, and each lane is forced through its own short suffix ("point i: title" and the start of
the model turn) before it samples; the expansions are joined in point order.

The router variant (SoT-R, as the earlier PASTA paper evaluates it) first asks whether the question
suits a list of independent points: `ModelRouter` reads the model's yes/no next-token logits on our
router prompt; `RuleRouter` is an offline heuristic (no model call) for smoke runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from pasta_jax.decode import api
from pasta_jax.decode.loop import bucket
from pasta_jax.decode.runtime import Runtime
from pasta_jax.errors import PastaError
from pasta_jax.judges.local import next_token_logits
from pasta_jax.lang.schema import THREAD, TOKEN
from pasta_jax.methods import Sequential, Sot, generate_ids

SKELETON_PROMPT = (
    "Plan an answer to the question below. Reply only with a numbered outline: {low} to {high} points, "
    "one per line, each point a short phrase of a few words (not a full answer).\n\n"
    "Question: {question}")
EXPAND_SHARED = (
    "Question: {question}\n\nOutline of the answer:\n{skeleton}\n\n"
    "You write one part of the answer. Expand only the point named below into one or two sentences; "
    "do not repeat the other points. Point ")
EXPAND_POINT = "{index}: {title}"
ROUTER_PROMPT = (
    "Can a good answer to this question be written as a list of independent points that could be "
    "written separately? Reply yes or no.\n\nQuestion: {question}")
POINT = re.compile(r"^\s*(?:[-*]\s*)?(\d{1,2})\s*[.)]\s*(.+?)\s*$")


@dataclasses.dataclass(frozen=True)
class SotConfig:
  min_points: int = 2  # fewer: no skeleton, decode normally
  max_points: int = 8  # more are dropped (the prompt asks for at most this many)
  skeleton_tokens: int = 96
  point_tokens: int = 96  # per point
  answer_tokens: int = 256  # the normal-decoding fallback
  lanes: int | None = None  # the expansion's lanes (None: the points' count, bucketed); `pasta serve` uses its own
  chat: bool = True
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class SotResult:
  text: str
  used_sot: bool
  skeleton: str
  points: tuple[str, ...]
  expansions: tuple[str, ...]
  steps: int  # skeleton steps + expansion steps (or the fallback's steps)
  seconds: float  # wall time of the interpreter runs, compile excluded
  peak_live_slots: int
  content_tokens: int  # tokens of the joined answer's parts the model wrote
  finished: bool
  note: str = ""


def extract_points(skeleton: str, max_points: int) -> list[str]:
  """Numbered lines 1, 2, 3, ... in order (numbering must start at 1 and not skip)."""
  points = []
  for line in skeleton.splitlines():
    match = POINT.match(line)
    if match and int(match.group(1)) == len(points) + 1 and match.group(2).strip():
      points.append(match.group(2).strip())
  return points[:max_points]


def skeleton_from_answer(answer: str, max_points: int) -> str | None:
  """A numbered outline from an answer's list items (their first words), or None without 2 items.
  Lets `sot-forced` exercise the parallel expansion with models that cannot write a skeleton."""
  from pasta_jax.data.structural import split_items, topic_of
  items = [topic_of(chunk, max_words=4) for kind, chunk in split_items(answer) if kind == "item"][:max_points]
  return "\n".join(f"{i}. {t}" for i, t in enumerate(items, start=1)) if len(items) >= 2 else None


def join_points(points: Sequence[str], expansions: Sequence[str]) -> str:
  parts = []
  for i, (title, body) in enumerate(zip(points, expansions, strict=True), start=1):
    body = body.strip()
    lead = f"{i}. {title}"
    parts.append(f"{lead}: {body}" if body else lead)
  return "\n".join(parts)


def _chat_ids(tokenizer, text: str, chat: bool) -> list[int]:
  return api.prompt_ids(tokenizer, [text], chat)[0]


def skeleton_prompt_ids(tokenizer, question: str, config: SotConfig) -> list[int]:
  """Stage 1's prompt: ask for a numbered outline of 3 to max_points points."""
  return _chat_ids(tokenizer, SKELETON_PROMPT.format(low=3, high=config.max_points, question=question), config.chat)


def _model_turn_suffix(tokenizer, chat: bool) -> str:
  """What follows the user text in a chat prompt (e.g. '<end_of_turn>\\n<start_of_turn>model\\n')."""
  if not chat:
    return "\n"
  marker = "\x00"
  full = api.chat_text(tokenizer, marker)
  return full.split(marker, 1)[1]


def _chat_prefix(tokenizer, chat: bool) -> str:
  if not chat:
    return ""
  marker = "\x00"
  return api.chat_text(tokenizer, marker).split(marker, 1)[0]


def expansion_inputs(tokenizer, question: str, skeleton: str, points: Sequence[str], chat: bool):
  """(shared prefix ids, per-point forced suffix ids): prefix + suffix_i is point i's full prompt."""
  lang = api.LangTokenizer(tokenizer)
  shared_text = _chat_prefix(tokenizer, chat) + EXPAND_SHARED.format(question=question, skeleton=skeleton.strip())
  shared = tokenizer.encode(shared_text, add_bos=True)
  turn = _model_turn_suffix(tokenizer, chat)
  suffixes = [lang.encode(EXPAND_POINT.format(index=i, title=title) + turn + f"{i}. {title}:")
              for i, title in enumerate(points, start=1)]
  return shared, suffixes


class SkeletonOfThought:
  """SoT on a loaded model (greedy, batch 1)."""

  def __init__(self, model, config: SotConfig = SotConfig(), router=None):
    if model.tokenizer is None:
      raise PastaError("Skeleton-of-Thought needs a model with a tokenizer")
    self.model, self.config, self.router = model, config, router

  def run(self, question: str, forced_skeleton: str | None = None) -> SotResult:
    """forced_skeleton: replay this outline as stage 1's answer (benchmarks and tests)."""
    cfg, tok = self.config, self.model.tokenizer
    if self.router is not None and not self.router.use_sot(question):
      return self._normal(question, "router chose normal decoding")
    script = None
    if forced_skeleton is not None:
      script = [[api.LangTokenizer(tok).encode(forced_skeleton) + [tok.tag_vocab().eos_ids[0]]]]
    [skel] = self._decode([skeleton_prompt_ids(tok, question, cfg)], cfg.skeleton_tokens, script)
    points = extract_points(skel.text, cfg.max_points)
    if len(points) < cfg.min_points:
      normal = self._normal(question, f"no skeleton ({len(points)} numbered points)")
      return dataclasses.replace(normal, skeleton=skel.text, steps=normal.steps + skel.steps,
                                 seconds=normal.seconds + skel.seconds)
    shared, suffixes = expansion_inputs(tok, question, skel.text, points, cfg.chat)
    fan_out = Sot(lanes=cfg.lanes or bucket(len(points), minimum=1), max_threads=max(len(points), 1))
    [expand] = generate_ids(self.model, [shared], fan_out, scripts=[suffixes],
                            max_new_tokens=cfg.point_tokens + max(map(len, suffixes)), runtime=Runtime(cfg.dtype))
    lang = api.LangTokenizer(tok)
    expansions = [point_expansion(expand.records, u, len(suffixes[u]), lang, tok.tag_vocab())
                  for u in range(len(points))]
    text = join_points(points, expansions)
    return SotResult(text=text, used_sot=True, skeleton=skel.text, points=tuple(points),
                     expansions=tuple(expansions), steps=skel.steps + expand.steps,
                     seconds=skel.seconds + expand.seconds,
                     peak_live_slots=max(skel.peak_live_slots, expand.peak_live_slots),
                     content_tokens=skel.content_tokens + expand.content_tokens - sum(map(len, suffixes)),
                     finished=skel.finished and expand.finished)

  def _decode(self, ids, budget: int, scripts=None):
    """Plain decoding (the skeleton, or the answer without one)."""
    return generate_ids(self.model, ids, Sequential(), scripts=scripts, max_new_tokens=budget,
                        runtime=Runtime(self.config.dtype))

  def _normal(self, question: str, note: str) -> SotResult:
    [answer] = self._decode([_chat_ids(self.model.tokenizer, question, self.config.chat)], self.config.answer_tokens)
    return SotResult(text=answer.text, used_sot=False, skeleton="", points=(), expansions=(), steps=answer.steps,
                     seconds=answer.seconds, peak_live_slots=answer.peak_live_slots,
                     content_tokens=answer.content_tokens, finished=answer.finished, note=note)


def point_expansion(records: np.ndarray, thread: int, skip: int, lang, vocab) -> str:
  """Thread's sampled text: its records after the forced suffix, end ids and tags dropped."""
  own = records[records[:, THREAD] == thread, TOKEN].tolist()[skip:]
  return lang.decode([t for t in own if t not in vocab.eos_ids and t not in vocab.tag_ids])


# --- routers -----------------------------------------------------------------------------------------
class RuleRouter:
  """Offline heuristic: SoT for open, list-like questions; not for code, math, rewriting or short facts."""

  NO = re.compile(r"\b(code|program|function|python|sql|calculate|solve|equation|translate|rewrite|"
                  r"paraphrase|summari[sz]e|poem|story|joke|what is the|who is|when did)\b", re.I)
  YES = re.compile(r"\b(tips|ways|steps|list|ideas|reasons|examples|advice|benefits|how can|how to|"
                   r"suggest|compare|pros|cons|factors)\b", re.I)

  def use_sot(self, question: str) -> bool:
    return bool(self.YES.search(question)) and not self.NO.search(question)


class ModelRouter:
  """The model itself decides: P(yes) > threshold on our router prompt (one forward, no decoding)."""

  def __init__(self, model, threshold: float = 0.5, chat: bool = True):
    tok = model.tokenizer
    self.model, self.threshold, self.chat = model, threshold, chat
    self.yes, self.no = _word_id(tok, "yes"), _word_id(tok, "no")

  def p_yes(self, question: str) -> float:
    ids = _chat_ids(self.model.tokenizer, ROUTER_PROMPT.format(question=question), self.chat)
    logits = next_token_logits(self.model, ids).astype(np.float64)
    pair = np.array([logits[self.yes], logits[self.no]], np.float64)
    pair = np.exp(pair - pair.max())
    return float(pair[0] / pair.sum())

  def use_sot(self, question: str) -> bool:
    return self.p_yes(question) > self.threshold


def _word_id(tokenizer, word: str) -> int:
  lang = api.LangTokenizer(tokenizer)
  for text in (word, word.capitalize(), " " + word):
    ids = lang.encode(text)
    if len(ids) == 1:
      return ids[0]
  raise PastaError(f"the tokenizer has no single token for {word!r}: the model router cannot read yes/no")


def theoretical_speedup(result: SotResult) -> float:
  """Sequential tokens / SoT steps (skeleton steps count: they are on the critical path)."""
  return result.content_tokens / result.steps if result.steps else math.nan
