"""The OpenAI-compatible request bodies `pasta serve` accepts, and its error bodies.

Bodies are validated strictly: an unknown field, a wrong type (`"7"` is not 7, `"yes"` is not true; an integer is
a float) or a value out of range is a 400 that names the field (OpenAI's error shape), never a silent default; so
is a string holding a lone surrogate (JSON can spell one, `"\\ud800"`, but no text encoding can carry it on).
Fields OpenAI defines that this server cannot honour (stop strings, presence and frequency penalties,
log-probabilities; several choices except from superposed decoding's drafts) are refused by name unless they carry
their neutral value. `temperature`, `top_p` and `seed` (0 <= seed < 2**32; a sampled request without one gets a
fresh one) are OpenAI's; `top_k` (0: off) and `repetition_penalty` are vLLM's extra sampling fields. Ours:
`method` (the decoding method; unset: the model's generation.json, else pasta), `return_trace` (the thread trace of
the answer), `timeout` (seconds; a non-streaming request not answered by then is cancelled and answered 504),
`pasta_threads` (a stream's chunks also carry each thread's new text: `serve/shapes.py`) and `fork_bias` (PASTA's
speed/quality knob: a logit offset on the token that opens a promise, in [-100, 100]; > 0 forks more, < 0 less;
0, the default, is off; a method without promises refuses any other value; `decode.sampling.SamplingConfig`) and
`max_topic_tokens` (the most tokens a PASTA promise's topic may have before main must close it; 0, the default, is
no cap; a method that writes no topics refuses any other value).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from pasta_jax.decode.sampling import TOPIC_LIMIT
from pasta_jax.methods import registry
from pasta_jax.model.tokenizer import END_OF_TURN, START_OF_TURN


class ApiError(Exception):
  """An error with an HTTP status and an OpenAI-style body."""

  def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}

  def body(self, code: int | str | None = None) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}


STRICT = pydantic.ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(pydantic.BaseModel):
  model_config = STRICT

  include_usage: bool = False  # a last chunk with the usage


class _Body(pydantic.BaseModel):
  model_config = STRICT

  model: str | None = None
  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=0.0, ge=0.0, le=2.0)
  top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0)
  stream: bool = False
  stream_options: StreamOptions | None = None
  seed: int | None = pydantic.Field(default=None, ge=0, lt=2**32)  # unset: a fresh one per sampled request
  user: str | None = None
  # Neutral values only (checked in `unsupported`): one choice (superposed: up to its k drafts), no stop
  # strings, no penalties, no logprobs.
  n: int = pydantic.Field(default=1, ge=1)
  stop: str | list[str] | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logprobs: Any = None
  # vLLM's extra fields: top-k (0: off) and CTRL's repetition penalty (unset: the model's generation.json, else 1)
  top_k: int = pydantic.Field(default=0, ge=0)
  repetition_penalty: float | None = pydantic.Field(default=None, gt=0.0, le=10.0)
  # Ours.
  method: str | None = None  # unset: the model's generation.json `method`, else pasta (`parse_body`)
  return_trace: bool = False
  timeout: float | None = pydantic.Field(default=None, gt=0.0)  # seconds (non-streaming only; `pasta serve` caps it)
  pasta_threads: bool = False  # streaming only: chunks with each thread's new text (`shapes.Shape.thread_events`)
  # the promise-open token's logit offset, this request's own (a batch mixes rows with any values in one program)
  fork_bias: float = pydantic.Field(default=0.0, ge=-100.0, le=100.0)
  max_topic_tokens: int = pydantic.Field(default=0, ge=0, lt=TOPIC_LIMIT)  # a promise topic's cap, 0: none

  def unsupported(self) -> str | None:
    """The first OpenAI field given a value this server cannot honour, or None."""
    given = {"n": self.n != 1 and not registry.METHODS[self.method].capabilities.drafts, "stop": bool(self.stop),
             "presence_penalty": self.presence_penalty != 0,
             "frequency_penalty": self.frequency_penalty != 0, "logprobs": self.logprobs not in (None, False)}
    return next((name for name, bad in given.items() if bad), None)


class CompletionBody(_Body):
  prompt: str | list[str]
  echo: bool = False
  max_completion_tokens: None = None  # chat only


class ChatMessage(pydantic.BaseModel):
  model_config = STRICT

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
  check_text(payload)
  try:
    body = kind.model_validate(payload)
  except pydantic.ValidationError as err:
    errors = err.errors()
    # a union's members each fail: the member that got furthest names the field best (`prompt.1`, not `prompt`)
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    if first["type"] == "extra_forbidden":
      where, what = ".".join(str(p) for p in first["loc"]), "unknown field"
    else:
      where, what = field_path(kind, first["loc"]), first["msg"]
    raise ApiError(400, f"{where}: {what}", param=where) from None
  if body.method is None:
    body = body.model_copy(update={"method": default_method})
  served = registry.names(serve=True)
  if body.method not in served:
    raise ApiError(400, f"method: unknown or unserved method {body.method!r}; use one of {', '.join(served)}",
                   param="method")
  if body.fork_bias != 0 and not registry.METHODS[body.method].capabilities.promises:
    raise ApiError(400, f"fork_bias: method {body.method!r} opens no promises, so it has no fork to bias; give 0 "
                   "or leave it out", param="fork_bias")
  if body.max_topic_tokens and not registry.METHODS[body.method].capabilities.topic_cap:
    raise ApiError(400, f"max_topic_tokens: method {body.method!r} writes no promise topics to cap; give 0 or leave "
                   "it out", param="max_topic_tokens")
  bad = body.unsupported()
  if bad:
    raise ApiError(400, f"{bad}: not supported by this server (leave it out or at its default)", param=bad)
  if isinstance(body, CompletionBody) and body.echo:
    raise ApiError(400, "echo: not supported by this server", param="echo")
  return body


def field_path(kind: type[pydantic.BaseModel], loc: tuple) -> str:
  """A validation error's field as a client names it: `messages.0.content`, without the union member labels
  pydantic adds to the location (`prompt.list[str].1` is `prompt.1`)."""
  parts, model = [], kind
  for part in loc:
    if isinstance(part, int):
      parts.append(str(part))
    elif model is not None and part in model.model_fields:
      parts.append(part)
      model = _model_in(model.model_fields[part].annotation)
    # else: a union member's label
  return ".".join(parts)


def _model_in(annotation) -> type[pydantic.BaseModel] | None:
  """The pydantic model an annotation holds (`list[ChatMessage]`, `StreamOptions | None`), if any."""
  if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
    return annotation
  for arg in getattr(annotation, "__args__", ()):
    if (found := _model_in(arg)) is not None:
      return found
  return None


def check_text(payload: Any) -> None:
  """ApiError(400) naming the first string (or key) of a parsed JSON body that holds a lone surrogate: JSON's
  `\\ud800` parses to one, and the tokenizer, the logs and the response's own UTF-8 would each fail on it later.
  Iterative: the body's depth is bounded only by the JSON parser's recursion limit."""
  stack: list[tuple[str, Any]] = [("", payload)]
  while stack:
    where, value = stack.pop()
    if isinstance(value, str):
      if _has_surrogate(value):
        name = where or "body"
        raise ApiError(400, f"{name}: a string holds a lone surrogate (not a Unicode character)", param=name)
    elif isinstance(value, dict):
      for key in value:
        if _has_surrogate(key):
          key = key.encode("utf-8", "backslashreplace").decode("utf-8")
          raise ApiError(400, f"{where + '.' if where else ''}{key}: a field name holds a lone surrogate",
                         param=where or None)
      stack.extend(reversed([(f"{where}.{key}" if where else key, item) for key, item in value.items()]))
    elif isinstance(value, list):
      stack.extend(reversed([(f"{where}.{i}" if where else str(i), item) for i, item in enumerate(value)]))


def _has_surrogate(text: str) -> bool:
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    return True
  return False


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
