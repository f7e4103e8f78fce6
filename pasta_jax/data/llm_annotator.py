"""The LLM annotator: any OpenAI-compatible endpoint marks the independent chunks of an answer in the
annotator form (`<async topic='x'>…</async>`, `<sync/>`); each reply is validated and converted to
promise form, with `tokens` from the blocks' true lengths (rounded to multiples of 10).

An LLM is the only annotator that sees meaning (which chunks really do not depend on each other),
but it also rewrites, drops and invents text. Training on an answer that is not the original would
teach the model something no one wrote, so validation is strict and every rejection keeps its
reason: a reply whose tags do not parse (the TagError names the place); one whose text, tags
removed, is not the answer byte for byte (edge whitespace and a code fence around the whole reply
are forgiven, as chat APIs lose or add them); a block under 5 words (too short to be worth a
fork); a topic over 3 words; a reply with no block.

`annotate_file` runs requests concurrently and appends one row per record id ({id, annotated,
reason}) as each finishes, so a killed run resumes where it stopped. Requests that still fail after
the client's retries are not written, so the rerun that resumes also retries them. Endpoint
settings come from PASTA_ANNOTATOR_BASE_URL / _MODEL / _API_KEY.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from pasta_jax.endpoint import ChatClient, EndpointConfig, EndpointError
from pasta_jax.errors import TagError
from pasta_jax.lang import text as T
from pasta_jax.model import runfiles

log = logging.getLogger(__name__)

ENV_PREFIX = "PASTA_ANNOTATOR"
PROMPT_VERSION = "annotator-v1"
MIN_BLOCK_WORDS, MAX_TOPIC_WORDS = 5, 3
MAX_REPLY_TOKENS = 8192  # many endpoints refuse larger max_tokens; longer answers are rare in SFT pools
# a wrong key, model or URL, or a redirect (never followed): every request would fail the same way
FATAL_STATUS = (301, 302, 303, 307, 308, 401, 403, 404)
MAX_FAILURES_IN_A_ROW = 8  # an endpoint that is down: stop, rather than spend hours retrying each answer
WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")  # words, not list markers or punctuation
ANSWER_HEADER = "Answer to mark up:\n"

SYSTEM = """\
You mark up answers so that a model can write their independent parts in parallel.

Wrap each chunk of the answer that could be written without seeing the other chunks (knowing only \
the question and the text before the first of them) in <async topic='...'>...</async>. Typical \
chunks: the items of a list, parallel paragraphs (one per option, aspect or example), independent \
sub-calculations. Put <sync/> right before text that depends on what the earlier chunks say, such \
as a summary, a comparison or a result computed from them.

Rules:
1. Copy the answer exactly, character for character: every word, space, newline and punctuation \
mark stays. Add tags only; never fix, reword, shorten or reorder anything.
2. Every block holds at least 5 words. Leave shorter pieces as they are.
3. Every topic has at most 3 words and says what the block is about.
4. Blocks are never nested. Text that must be written in order stays outside blocks.
5. Use <sync/> sparingly: only where later text really needs the blocks' content.
6. If no chunk is independent, return the answer unchanged, without tags.

Reply with the marked-up answer only: no introduction, no explanation, no code fence."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One worked example, shown to the LLM as a user turn and its ideal reply."""

  instruction: str
  answer: str
  annotated: str  # the answer in the annotator form (equal to `answer` when nothing is independent)


EXAMPLES = (
    Example(
        "Give me three tips for sleeping better.",
        "Here are three tips:\n- Keep a fixed bedtime, even on weekends.\n- Avoid screens for an hour before "
        "bed.\n- Keep the bedroom cool, dark and quiet.\nTogether these habits make falling asleep easier.",
        "Here are three tips:\n<async topic='fixed bedtime'>- Keep a fixed bedtime, even on weekends.\n</async>"
        "<async topic='no screens'>- Avoid screens for an hour before bed.\n</async>"
        "<async topic='bedroom'>- Keep the bedroom cool, dark and quiet.\n</async><sync/>"
        "Together these habits make falling asleep easier."),
    Example(
        "Should I get a cat or a dog?",
        "Both make good pets, but they suit different lives.\n\nCats are independent and need little space; "
        "they suit small flats and owners who are out all day.\n\nDogs need daily walks and company, but they "
        "are loyal, playful and easy to train.\n\nIf you are often away, a cat is the safer choice.",
        "Both make good pets, but they suit different lives.\n\n<async topic='cats'>Cats are independent and "
        "need little space; they suit small flats and owners who are out all day.</async>\n\n"
        "<async topic='dogs'>Dogs need daily walks and company, but they are loyal, playful and easy to train."
        "</async>\n\n<sync/>If you are often away, a cat is the safer choice."),
    Example(
        "Pens cost $2 and notebooks $5. What do 3 pens and 2 notebooks cost?",
        "Three pens cost 3 × $2 = $6. Two notebooks cost 2 × $5 = $10. So the total is $6 + $10 = $16.",
        "<async topic='pens'>Three pens cost 3 × $2 = $6.</async> <async topic='notebooks'>Two notebooks "
        "cost 2 × $5 = $10.</async> <sync/>So the total is $6 + $10 = $16."),
    Example(
        "What is the capital of Australia?",
        "The capital of Australia is Canberra, not Sydney.",
        "The capital of Australia is Canberra, not Sydney."),
)


@dataclasses.dataclass(frozen=True)
class Annotation:
  annotated: str | None  # promise form, None if rejected
  reason: str  # why it was rejected ("" if accepted)


# --- the prompt ----------------------------------------------------------------------------------------
def user_turn(instruction: str, answer: str) -> str:
  return f"Question:\n{instruction}\n\n{ANSWER_HEADER}{answer}"


def messages(instruction: str, answer: str) -> list[dict]:
  """System rules, our worked examples as earlier turns, then the answer to mark up."""
  out = [{"role": "system", "content": SYSTEM}]
  for ex in EXAMPLES:
    out += [{"role": "user", "content": user_turn(ex.instruction, ex.answer)},
            {"role": "assistant", "content": ex.annotated}]
  return out + [{"role": "user", "content": user_turn(instruction, answer)}]


def record_instruction(record: Mapping) -> str:
  """The question as the annotator sees it: instruction, then the record's input if any."""
  instruction, extra = str(record.get("instruction") or "").strip(), str(record.get("input") or "").strip()
  return f"{instruction}\n\n{extra}" if extra else instruction


def reply_budget(answer: str) -> int:
  """max_tokens for the reply: the answer (about 4 characters a token, so len/2 is ample) plus tags."""
  return min(MAX_REPLY_TOKENS, len(answer) // 2 + 512)


# --- validation ----------------------------------------------------------------------------------------
def words(text: str) -> int:
  return len(WORD.findall(text))


def validate(reply: str, answer: str, count_tokens: Callable[[str], int]) -> Annotation:
  """The reply as promise form, or the reason it is rejected."""
  try:
    reply = forgive(reply, answer)
    segments = T.parse_annotator_form(reply)
  except TagError as err:
    return Annotation(None, f"malformed tags: {err}")
  altered = difference(T.strip_tags(segments), answer)
  if altered:
    return Annotation(None, f"content altered: {altered}")
  promises = [s for s in segments if isinstance(s, T.Promise)]
  if not promises:
    return Annotation(None, "no block marked")
  for promise in promises:
    if not promise.topic.strip():
      return Annotation(None, "empty topic")
    if len(promise.topic.split()) > MAX_TOPIC_WORDS:
      return Annotation(None, f"topic {promise.topic!r} has more than {MAX_TOPIC_WORDS} words")
  for block in (s for s in segments if isinstance(s, T.Block)):
    if words(block.text) < MIN_BLOCK_WORDS:
      return Annotation(None, f"block {_short(block.text.strip())} has fewer than {MIN_BLOCK_WORDS} words")
  try:
    return Annotation(T.from_annotator_form(reply, count_tokens), "")
  except TagError as err:
    return Annotation(None, f"cannot convert: {err}")


def forgive(reply: str, answer: str) -> str:
  """Undoes what chat APIs and chatty models do to a faithful reply: a code fence around all of it,
  and whitespace lost or added at its edges (put back as the answer has it). Raises TagError."""
  fenced = re.fullmatch(r"\s*```[\w-]*\n(.*?)\n?```\s*", reply, re.S)
  if fenced and not answer.lstrip().startswith("```"):
    reply = fenced.group(1)
  stripped = T.strip_annotator_tags(reply)
  if stripped != answer and stripped.strip() == answer.strip():
    lead, trail = answer[: len(answer) - len(answer.lstrip())], answer[len(answer.rstrip()):]
    reply = lead + reply.strip() + trail
  return reply


def difference(got: str, expected: str) -> str:
  """'' if equal, else where and how the reply's text departs from the answer."""
  if got == expected:
    return ""
  at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
  return (f"the text without tags differs from the answer at character {at}: "
          f"expected {_short(expected[at:])}, got {_short(got[at:])}")


def _short(text: str, limit: int = 30) -> str:
  return repr(text[:limit] + ("..." if len(text) > limit else ""))


def precheck(answer: str) -> str:
  """A reason not to ask at all ('' if the answer can be annotated)."""
  if not answer.strip():
    return "empty answer"
  tag = T.ANNOTATOR_PATTERN.search(answer) or T.TAG_PATTERN.search(answer)
  if tag:
    return f"the answer itself contains the tag text {tag.group()!r}: its annotation could not be read back"
  return ""


# --- running -------------------------------------------------------------------------------------------
def annotate_record(client: ChatClient, record: Mapping, count_tokens: Callable[[str], int]) -> Annotation:
  """One record's annotation; raises EndpointError when the endpoint fails past its retries."""
  answer = str(record.get("output") or "")
  reason = precheck(answer)
  if reason:
    return Annotation(None, reason)
  reply = client.complete(messages(record_instruction(record), answer), max_tokens=reply_budget(answer),
                          temperature=0.0)
  return validate(reply.text, answer, count_tokens)


def annotate_file(records: Sequence[Mapping], client: ChatClient, out_path: str | Path,
                  count_tokens: Callable[[str], int], *, concurrency: int = 4, progress: bool = True) -> dict:
  """Annotates every record whose id is not yet in `out_path` (JSONL rows {id, annotated, reason}).

  Returns counts over `records`: records (rows now present), accepted, rejected, resumed (rows found
  from an earlier run). Raises EndpointError, after writing every finished row, if the endpoint
  refuses the key, model or URL, or if some requests failed past their retries (rerun to resume).
  """
  if concurrency < 1:
    raise EndpointError(f"concurrency must be at least 1, got {concurrency}")
  out_path = Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  unique: dict[str, Mapping] = {}
  for record in records:
    unique.setdefault(str(record["id"]), record)  # a repeated id is annotated once
  done = {str(row["id"]) for row in runfiles.read_rows(out_path) if "id" in row}
  todo = [(rid, record) for rid, record in unique.items() if rid not in done]
  failed = _run(todo, client, out_path, count_tokens, concurrency,
                tqdm(total=len(unique), initial=len(unique) - len(todo), desc="annotating", unit="answer",
                     disable=not progress))
  if failed:
    raise EndpointError(f"{len(failed)} of {len(todo)} answers got no reply after retries (last: {failed[-1]}); "
                        f"{out_path} keeps the others: rerun to resume")
  rows = {str(row["id"]): row for row in runfiles.read_rows(out_path) if "id" in row}
  mine = [rows[rid] for rid in unique if rid in rows]
  accepted = sum(row.get("annotated") is not None for row in mine)
  return {"records": len(mine), "accepted": accepted, "rejected": len(mine) - accepted,
          "resumed": len(unique) - len(todo)}


def _run(todo, client, out_path: Path, count_tokens, concurrency: int, bar) -> list[str]:
  """Runs the requests; rows are appended by this (one) thread as results come. Returns the failures."""
  failed, in_a_row, outcomes = [], 0, Counter()
  pool = ThreadPoolExecutor(max_workers=concurrency)
  try:
    futures = {pool.submit(annotate_record, client, record, count_tokens): rid for rid, record in todo}
    for future in as_completed(futures):
      rid = futures[future]
      try:
        result, in_a_row = future.result(), 0
      except EndpointError as err:
        if err.status in FATAL_STATUS:
          raise
        if err.status is None:  # gave up after retries: not written, so a rerun retries it
          failed.append(f"{rid}: {err}")
          log.warning("annotator: no reply for record %s after retries; a rerun retries it", rid)
          in_a_row += 1
          if in_a_row >= MAX_FAILURES_IN_A_ROW:
            raise EndpointError(f"{in_a_row} requests in a row failed after retries (last: {err}); the endpoint "
                                f"seems down: rerun to resume") from None
          bar.update(1)
          continue
        result = Annotation(None, f"endpoint refused this answer: {err}")  # e.g. 400: too long for the model
      runfiles.append_row(out_path, {"id": rid, "annotated": result.annotated, "reason": result.reason})
      outcomes["rejected" if result.annotated is None else "accepted"] += 1
      bar.update(1)
      bar.set_postfix(outcomes)
  except BaseException:
    pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C or a fatal error: do not wait for the queue
    raise
  finally:
    bar.close()
  pool.shutdown()
  return failed


def client_from_env(**overrides) -> ChatClient:
  """A client for the PASTA_ANNOTATOR_* endpoint (overrides: EndpointConfig fields, e.g. requests_per_minute)."""
  return ChatClient(EndpointConfig.from_env(prefix=ENV_PREFIX, **overrides))
