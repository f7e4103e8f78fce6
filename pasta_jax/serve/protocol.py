"""The OpenAI-compatible request bodies `pasta serve` accepts, and its error bodies.

Bodies are validated strictly: an unknown field, a wrong type or a value out of range is a 400 that names
the field (OpenAI's error shape), never a silent default. Fields OpenAI defines that this server cannot
honour (several choices, stop strings, penalties, log-probabilities, a seed: a sampled row's key folds in its
batch row and step, so no per-request seed can be kept) are refused by name unless they carry their neutral
value. Two fields are ours: `method` (the decoding method; unset: the model's generation.json, else pasta) and
`return_trace` (the thread trace of the answer).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pasta_jax.methods import registry
from pasta_jax.model.tokenizer import END_OF_TURN, START_OF_TURN


class ApiError(Exception):
  """An error with an HTTP status and an OpenAI-style body."""

  def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=False)

  model: str | None = None
  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=0.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
  stream: bool = False
  stream_options: dict | None = None
  seed: int | None = None
  user: str | None = None
  # Neutral values only (checked in `unsupported`): one choice (superposed: up to its k drafts), no stop
  # strings, no penalties, no logprobs.
  n: int = pydantic.Field(default=1, ge=1)
  stop: str | list[str] | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logprobs: Any = None
  # Ours.
  method: str | None = None  # unset: the model's generation.json `method`, else pasta (`parse_body`)
  return_trace: bool = False
  # vLLM's extra field (CTRL's penalty); unset: the model's generation.json, else 1 (off)
  repetition_penalty: float | None = pydantic.Field(default=None, gt=0.0, le=10.0)

  def unsupported(self) -> str | None:
    """The first OpenAI field given a value this server cannot honour, or None."""
    given = {"n": self.n != 1 and not registry.METHODS[self.method].capabilities.drafts, "stop": bool(self.stop),
             "seed": self.seed is not None,
             "presence_penalty": self.presence_penalty != 0,
             "frequency_penalty": self.frequency_penalty != 0, "logprobs": self.logprobs not in (None, False)}
    return next((name for name, bad in given.items() if bad), None)


class CompletionBody(_Body):
  prompt: str | list[str]
  echo: bool = False
  max_completion_tokens: None = None  # chat only


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")

  role: Literal["system", "user", "assistant"]
  content: str
  name: str | None = None


class ChatBody(_Body):
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)


def parse_body(kind: type[_Body], payload: Any, default_method: str = "pasta") -> _Body:
  """A validated body (`method` unset: `default_method`), or ApiError(400) naming the first bad field."""
  if not isinstance(payload, dict):
    raise ApiError(400, "the request body must be a JSON object")
  try:
    body = kind.model_validate(payload)
  except pydantic.ValidationError as err:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    what = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    raise ApiError(400, f"{where}: {what}", param=where) from None
  if body.method is None:
    body = body.model_copy(update={"method": default_method})
  served = registry.names(serve=True)
  if body.method not in served:
    raise ApiError(400, f"method: unknown or unserved method {body.method!r}; use one of {', '.join(served)}",
                   param="method")
  bad = body.unsupported()
  if bad:
    raise ApiError(400, f"{bad}: not supported by this server (leave it out or at its default)", param=bad)
  if isinstance(body, CompletionBody) and body.echo:
    raise ApiError(400, "echo: not supported by this server", param="echo")
  return body


def chat_prompt_text(messages: list[ChatMessage], format_single) -> str:
  """Gemma's chat turns for a conversation, opening the model's turn. A system message is folded into the
  first user turn (Gemma has no system role); one user message gives exactly `format_single(text)`, what
  `generate(chat=True)` uses."""
  turns, system = [], []
  for message in messages:
    if message.role == "system":
      system.append(message.content)
      continue
    text = "\n\n".join(system + [message.content]) if message.role == "user" and system else message.content
    if message.role == "user":
      system = []
    turns.append(("user" if message.role == "user" else "model", text))
  if not turns or turns[-1][0] != "user":
    raise ApiError(400, "messages: the conversation must end with a user message", param="messages")
  if len(turns) == 1:
    return format_single(turns[0][1])
  return "".join(f"{START_OF_TURN}{role}\n{text}{END_OF_TURN}\n" for role, text in turns) + f"{START_OF_TURN}model\n"


def sot_question(body) -> str | None:
  """A staged method's question (SoT's: it plans from one question, not a conversation): the one user message."""
  if not registry.METHODS[body.method].capabilities.needs_scripts:
    return None
  turns = [m for m in body.messages if m.role != "system"]
  if len(turns) != 1 or any(m.role == "system" for m in body.messages):
    raise ApiError(400, f"messages: method {body.method!r} answers one user message (no system message, no "
                   "history)", param="messages")
  return turns[0].content
