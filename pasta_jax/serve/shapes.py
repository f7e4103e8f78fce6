"""OpenAI's response shapes for one served request: a whole completion or chat answer, its stream's chunks, and
the `pasta` extras (method, steps, stop reason, speedup, and on request the thread trace)."""

from __future__ import annotations

import json
import time

from pasta_jax.serve.requests import Request, Update


def sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


class Shape:
  """OpenAI's response shapes for one request (completion or chat, whole or chunked)."""

  def __init__(self, request: Request, model: str, chat: bool, trace: bool, prompt_tokens: int, stream_usage: bool,
               n: int = 1):
    self.request, self.model, self.chat, self.trace, self.prompt_tokens = request, model, chat, trace, prompt_tokens
    self.n = n  # choices: superposed decoding's best n drafts
    self.stream_usage = stream_usage  # stream_options.include_usage: a last chunk with the usage
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

  def chunk(self, delta: str, end: Update | None, first: bool = False, index: int = 0) -> dict:
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
    return out

  def usage_chunk(self, update: Update) -> dict:
    out = self.chunk("", None)
    out["choices"], out["usage"] = [], self.usage(update)
    return out
