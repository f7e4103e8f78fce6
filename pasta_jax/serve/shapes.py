"""OpenAI's response shapes for one served request: a whole completion or chat answer, its stream's chunks, and
the `pasta` extras (method, steps, stop reason, speedup, and on request the thread trace).

A stream asked with `pasta_threads: true` carries, besides the answer's text, each thread's own new text: a chunk
whose `pasta_threads` lists the threads that moved since the last chunk (chunks with no new answer text are sent
for it too, their delta empty; a stream that did not ask sees nothing new):

  "pasta_threads": [{"thread": 1, "parent": 0, "text": " eight hours", "steps": [12, 13], "done": false}, ...]

`thread`: 0 is main, forks count in spawn order; `parent`: the thread that spawned it (null: main, or a method
with no thread tree); `text`: what the thread wrote since its last event (tags and topics hidden,
`decode/thread_text.py`), to append; `steps`: the new steps at which it wrote a token (tags included), counted from
the request's admission; `done`: its text is whole. The first event of a thread introduces it. Rarely (a
detokenizer that reads a thread's ids differently once more follow) a thread's text no longer extends what was sent:
its event then has `"reset": true` and `text` is the thread's whole text so far, to replace.
"""

from __future__ import annotations

import json
import time

from pasta_jax.decode.streaming import delta as text_delta
from pasta_jax.decode.thread_text import ThreadText
from pasta_jax.serve.requests import Request, Update


def sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


class Shape:
  """OpenAI's response shapes for one request (completion or chat, whole or chunked)."""

  def __init__(self, request: Request, model: str, chat: bool, trace: bool, prompt_tokens: int, stream_usage: bool,
               n: int = 1, threads: bool = False):
    self.request, self.model, self.chat, self.trace, self.prompt_tokens = request, model, chat, trace, prompt_tokens
    self.n = n  # choices: superposed decoding's best n drafts
    self.stream_usage = stream_usage  # stream_options.include_usage: a last chunk with the usage
    self.threads = ThreadEvents() if threads else None  # pasta_threads: each thread's new text in the chunks
    self.created = int(time.time())
    self.object = "chat.completion" if chat else "text_completion"

  def usage(self, update: Update) -> dict:
    done = update.result.content_tokens if update.result is not None else self.request.counted
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done}

  def extras(self, update: Update) -> dict:
    out = {"method": self.request.method.name, "note": update.note}
    result = update.result
    if result is not None:
      out.update(steps=result.steps, stop_reason=result.stop_reason,
                 theoretical_speedup=None if result.theoretical_speedup != result.theoretical_speedup
                 else result.theoretical_speedup)
      if result.refusals:  # what a limit held back is said with the answer (`Result.refused`: what it was)
        out.update(refusals=result.refusals, refused=result.refused)
      if self.trace:
        out["annotated"] = result.annotated
        out["threads"] = [{"thread": t.thread, "lane": t.lane, "spawn_step": t.spawn_step,
                           "finish_step": t.finish_step, "tokens": t.tokens} for t in result.threads]
    return out

  def texts(self, text: str, update: Update) -> list[str]:
    """Each choice's text: the answer, or superposed decoding's best n drafts (the first is the answer)."""
    drafts = update.result.drafts if update.result is not None else ()
    return [text, *drafts[1:self.n]] if self.n > 1 else [text]

  def whole(self, text: str, update: Update) -> dict:
    choices = []
    for index, content in enumerate(self.texts(text, update)):
      choice = {"index": index, "finish_reason": update.finish_reason, "logprobs": None}
      choice.update({"message": {"role": "assistant", "content": content}} if self.chat else {"text": content})
      choices.append(choice)
    return {"id": self.request.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": choices, "usage": self.usage(update), "pasta": self.extras(update)}

  def thread_events(self, update: Update) -> list[dict]:
    """The `pasta_threads` events of an update: the threads that moved since the last ([] if none, or not asked)."""
    if self.threads is None or not update.threads:
      return []
    return self.threads.events(update.threads)

  def chunk(self, delta: str, end: Update | None, first: bool = False, index: int = 0,
            threads: list[dict] | None = None) -> dict:
    reason = end.finish_reason if end is not None else None
    if self.chat:
      piece = {"role": "assistant", "content": delta} if first or index else ({"content": delta} if delta else {})
      choice = {"index": index, "delta": piece, "finish_reason": reason, "logprobs": None}
    else:
      choice = {"index": index, "text": delta, "finish_reason": reason, "logprobs": None}
    out = {"id": self.request.id, "object": f"{self.object}.chunk" if self.chat else self.object,
           "created": self.created, "model": self.model, "choices": [choice]}
    if end is not None:
      out["pasta"] = self.extras(end)
    if threads:
      out["pasta_threads"] = threads
    return out

  def usage_chunk(self, update: Update) -> dict:
    out = self.chunk("", None)
    out["choices"], out["usage"] = [], self.usage(update)
    return out


class ThreadEvents:
  """What of each thread a stream has sent, and the events that bring a client up to date (see the module's doc)."""

  def __init__(self):
    self.sent: dict[int, str] = {}  # thread -> its text sent so far
    self.steps_sent: dict[int, int] = {}  # thread -> how many of its steps were sent
    self.done: set[int] = set()

  def events(self, threads: tuple[ThreadText, ...]) -> list[dict]:
    out = []
    for thread in threads:
      key = thread.thread
      new = key not in self.sent
      sent = self.sent.get(key, "")
      steps = thread.steps[self.steps_sent.get(key, 0):]
      added = text_delta(sent, thread.text)
      ends = thread.done and key not in self.done
      if not (new or added or added is None or steps or ends):
        continue
      event = {"thread": key, "parent": thread.parent, "text": thread.text if added is None else added,
               "steps": sorted(set(steps)), "done": thread.done}
      if added is None:
        event["reset"] = True
      out.append(event)
      self.sent[key], self.steps_sent[key] = thread.text, len(thread.steps)
      if thread.done:
        self.done.add(key)
    return out
