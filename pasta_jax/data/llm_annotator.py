"""The LLM annotator: any OpenAI-compatible endpoint marks the independent chunks of an answer in the
annotator form (`<async topic='x'>…</async>`, `<sync/>`), which is validated and converted to
promise form with `tokens` from the true lengths (rounded to 10).

Validation rejects, with the reason: a reply that does not parse (the TagError names the place);
one whose text, tags removed, differs from the answer in any byte; a block under 5 words; a topic
over 3 words; a reply with no block. `annotate_file` runs requests concurrently, resumes from its
output (one row per record id), and never loses or duplicates a row. Endpoint settings come from
PASTA_ANNOTATOR_BASE_URL / _MODEL / _API_KEY.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from pasta_jax import runfiles
from pasta_jax.endpoint import ChatClient, EndpointConfig, EndpointError
from pasta_jax.errors import TagError
from pasta_jax.lang import text as T

MIN_BLOCK_WORDS, MAX_TOPIC_WORDS = 5, 3
SYSTEM = (
    "You mark up answers for parallel decoding. Wrap each chunk of the answer that can be written "
    "independently of the other chunks (given only the text before it) in <async topic='...'>...</async>, "
    "and put <sync/> right before text that depends on earlier chunks' content. Rules: copy the answer "
    "exactly, character for character, adding only tags; every block has at least 5 words; every topic has "
    "at most 3 words; no nested blocks; use <sync/> sparingly; leave text outside blocks where it must be "
    "written in order. Reply with the marked-up answer only.")
EXAMPLES = (
    ("Give three tips for better sleep.",
     "Here are three tips:\n- Keep a fixed bedtime, even on weekends.\n- Avoid screens for an hour before bed.\n"
     "- Keep the bedroom cool and dark.\nTogether these make falling asleep easier.",
     "Here are three tips:\n<async topic='fixed bedtime'>- Keep a fixed bedtime, even on weekends.\n</async>"
     "<async topic='no screens'>- Avoid screens for an hour before bed.\n</async>"
     "<async topic='cool dark room'>- Keep the bedroom cool and dark.\n</async><sync/>"
     "Together these make falling asleep easier."),
    ("Compare cats and dogs as pets.",
     "Cats are independent and need little space; they suit small flats and busy owners. Dogs need daily "
     "walks and company, but they are loyal and easy to train. The better pet depends on your time.",
     "<async topic='cats'>Cats are independent and need little space; they suit small flats and busy owners."
     "</async> <async topic='dogs'>Dogs need daily walks and company, but they are loyal and easy to train."
     "</async> <sync/>The better pet depends on your time."),
    ("What is 17 times 3?",
     "17 times 3 is 51.",
     "17 times 3 is 51."),
)


@dataclasses.dataclass(frozen=True)
class Annotation:
  annotated: str | None  # promise form, None if rejected
  reason: str  # why it was rejected ("" if accepted)


def messages(instruction: str, answer: str) -> list[dict]:
  out = [{"role": "system", "content": SYSTEM}]
  for q, a, marked in EXAMPLES:
    out += [{"role": "user", "content": f"Question: {q}\n\nAnswer:\n{a}"}, {"role": "assistant", "content": marked}]
  return out + [{"role": "user", "content": f"Question: {instruction}\n\nAnswer:\n{answer}"}]


def validate(reply: str, answer: str, count_tokens: Callable[[str], int]) -> Annotation:
  """The reply as promise form, or the reason it is rejected."""
  try:
    segments = T.parse_annotator_form(reply)
  except TagError as err:
    return Annotation(None, f"malformed tags: {err}")
  stripped = T.strip_tags(segments)
  if stripped != answer:
    at = next((i for i, (a, b) in enumerate(zip(stripped, answer)) if a != b), min(len(stripped), len(answer)))
    return Annotation(None, f"content altered: the text without tags differs from the answer at character {at}")
  blocks = [s for s in segments if isinstance(s, T.Block)]
  if not blocks:
    return Annotation(None, "no block marked")
  for seg in segments:
    if isinstance(seg, T.Promise) and len(seg.topic.split()) > MAX_TOPIC_WORDS:
      return Annotation(None, f"topic {seg.topic!r} has more than {MAX_TOPIC_WORDS} words")
  for block in blocks:
    if len(block.text.split()) < MIN_BLOCK_WORDS:
      return Annotation(None, f"block {block.text.strip()[:40]!r} has fewer than {MIN_BLOCK_WORDS} words")
  try:
    return Annotation(T.from_annotator_form(reply, count_tokens), "")
  except TagError as err:
    return Annotation(None, f"cannot convert: {err}")


def annotate_one(client: ChatClient, record: Mapping[str, str], count_tokens) -> Annotation:
  answer = str(record.get("output") or "")
  if not answer.strip():
    return Annotation(None, "empty answer")
  prompt = record.get("instruction", "") + (f"\n\n{record['input']}" if record.get("input") else "")
  try:
    reply = client.complete(messages(prompt, answer), max_tokens=4 * len(answer) // 3 + 256)
  except EndpointError as err:
    return Annotation(None, f"endpoint failed: {err}")
  return validate(reply.text, answer, count_tokens)


def annotate_file(records: Sequence[Mapping[str, str]], client: ChatClient, out_path: str | Path,
                  count_tokens: Callable[[str], int], *, concurrency: int = 4, progress: bool = True) -> dict:
  """Annotates every record not yet in `out_path` (JSONL rows {id, annotated, reason}); returns counts."""
  out_path = Path(out_path)
  done = {row["id"] for row in runfiles.read_rows(out_path)}
  todo = [r for r in records if str(r["id"]) not in done]
  lock = threading.Lock()
  with ThreadPoolExecutor(max_workers=concurrency) as pool, \
      tqdm(total=len(todo), desc="annotating", disable=not progress) as bar:
    futures = {pool.submit(annotate_one, client, r, count_tokens): r for r in todo}
    for future in as_completed(futures):
      record, result = futures[future], future.result()
      with lock:
        runfiles.append_row(out_path, {"id": str(record["id"]), "annotated": result.annotated,
                                       "reason": result.reason})
      bar.update(1)
  rows = list(runfiles.read_rows(out_path))
  return {"records": len(rows), "accepted": sum(r["annotated"] is not None for r in rows),
          "rejected": sum(r["annotated"] is None for r in rows)}


def client_from_env() -> ChatClient:
  return ChatClient(EndpointConfig.from_env(prefix="PASTA_ANNOTATOR"))
