"""`pasta serve`'s HTTP face: an OpenAI-compatible FastAPI app over the `Engine`.

  POST /v1/completions, /v1/chat/completions   (server-sent events with `stream: true`)
  GET  /v1/models, /health, /metrics

Every failure is an OpenAI-style error body with its status: 400 for bad input (naming the field), 404 for an
unknown model, 429 with Retry-After when the queue is full, 503 while shutting down or after an engine
failure. A streaming client that disconnects is cancelled: its row is freed at the next chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import fastapi
import uvicorn
from fastapi import responses

from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.tokenizing import chat_text
from pasta_jax.errors import PastaError
from pasta_jax.methods import Pasta, registry
from pasta_jax.model.load import generation_defaults
from pasta_jax.serve import protocol
from pasta_jax.serve.engine import Engine, QueueFull, Request, ShuttingDown, Update
from pasta_jax.serve.protocol import ApiError, ChatBody, CompletionBody

POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there
# How long an idle keep-alive connection stays open. Longer than clients' own pool expiry (httpx, and so the
# `openai` client: 5 s), so the client always drops an idle connection first: at uvicorn's default (also 5 s) a
# client could reuse a connection the server was closing that instant and get "connection reset by peer".
KEEP_ALIVE_S = 75


class GracefulServer(uvicorn.Server):
  """uvicorn, stopping the engine first on shutdown (SIGTERM): running requests get `grace_s` to finish,
  then are cut with finish_reason "length"; their streams end with a last event and `[DONE]`, so the
  connections close cleanly before uvicorn's own (short) grace period."""

  def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float):
    super().__init__(config)
    self.engine, self.grace_s = engine, grace_s

  async def shutdown(self, sockets=None):
    await asyncio.to_thread(self.engine.stop, self.grace_s)
    await super().shutdown(sockets)


def make_server(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                grace_s: float = 10.0) -> GracefulServer:
  config = uvicorn.Config(create_app(engine, model_name, grace_s), host=host, port=port, log_level="warning",
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
  return GracefulServer(config, engine, grace_s)


def create_app(engine: Engine, model_name: str, grace_s: float = 10.0) -> fastapi.FastAPI:
  """The app over a started engine; its shutdown stops the engine (a backstop: `GracefulServer` does it first)."""

  @contextlib.asynccontextmanager
  async def lifespan(_):
    yield
    await asyncio.to_thread(engine.stop, grace_s)

  app = fastapi.FastAPI(title="pasta_jax", docs_url=None, redoc_url=None, lifespan=lifespan)
  defaults = generation_defaults(engine.model)
  default_method = defaults.get("method", Pasta.name)  # the format the model was trained to write
  if default_method not in registry.names(serve=True):
    raise PastaError(f"{engine.model.source}: its generation.json names method {default_method!r}, which this server "
                     f"does not serve ({', '.join(registry.names(serve=True))})")
  created = int(time.time())

  @app.exception_handler(ApiError)
  async def api_error(_, err: ApiError):
    return responses.JSONResponse(err.body(), status_code=err.status, headers=err.headers)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def validation_error(_, err):
    return responses.JSONResponse(ApiError(400, str(err)).body(), status_code=400)

  @app.get("/health")
  async def health():
    if engine.error is not None:
      raise ApiError(503, f"engine failed: {engine.error}", kind="server_error")
    return {"status": "draining" if engine.stopping else "ok", "model": model_name, "running": engine.running,
            "queued": len(engine.waiting)}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "pasta_jax"}]}

  @app.get("/metrics")
  async def metrics():
    return responses.Response(engine.metrics.text(), media_type="text/plain; version=0.0.4")

  @app.post("/v1/completions")
  async def completions(http: fastapi.Request):
    body = protocol.parse_body(CompletionBody, await _json(http), default_method)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
      raise ApiError(400, "prompt: give one prompt per request", param="prompt")
    if not prompts[0]:
      raise ApiError(400, "prompt: empty prompt", param="prompt")
    ids = engine.model.tokenizer.encode(prompts[0], add_bos=True)
    return await _serve(http, body, ids, chat=False, question=prompts[0])

  @app.post("/v1/chat/completions")
  async def chat_completions(http: fastapi.Request):
    body = protocol.parse_body(ChatBody, await _json(http), default_method)
    text = protocol.chat_prompt_text(body.messages, lambda t: chat_text(engine.model.tokenizer, t))
    ids = engine.model.tokenizer.encode(text, add_bos=True)
    return await _serve(http, body, ids, chat=True, question=protocol.sot_question(body))

  async def _serve(http: fastapi.Request, body, ids: list[int], chat: bool, question: str | None = None):
    if body.model not in (None, model_name):
      raise ApiError(404, f"model: this server serves {model_name!r}, not {body.model!r}", param="model",
                     kind="not_found_error")
    updates: asyncio.Queue[Update] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or engine.cfg.default_max_tokens
    method = engine.method_named(body.method)
    if body.n > method.max_choices:
      raise ApiError(400, f"n: method {method.name!r} here writes {method.max_choices} drafts; ask for at most that "
                     "many", param="n")
    def sink(update: Update) -> None:  # called from the engine thread
      with contextlib.suppress(RuntimeError):  # the event loop already closed (the server is gone)
        loop.call_soon_threadsafe(updates.put_nowait, update)

    request = Request(ids=ids, method=method, max_tokens=max_tokens, sampling=request_sampling(body, defaults),
                      sink=sink, question=question, chat=chat)
    try:
      engine.submit(request)
    except QueueFull as err:
      raise ApiError(429, str(err), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ShuttingDown as err:
      raise ApiError(503, str(err), kind="server_error") from None
    except PastaError as err:
      raise ApiError(400, str(err), param="max_tokens" if "max_tokens" in str(err) else "prompt") from None
    usage = bool((body.stream_options or {}).get("include_usage"))
    shape = _Shape(request, model_name, chat, body.return_trace, len(ids), usage, body.n)
    if body.stream:
      return responses.StreamingResponse(_events(http, request, updates, shape), media_type="text/event-stream")
    return await _whole(http, request, updates, shape)

  async def _whole(http, request, updates, shape):
    text, last = [], None
    while last is None or not last.done:
      try:
        last = await asyncio.wait_for(updates.get(), POLL_S)
      except asyncio.TimeoutError:
        if await http.is_disconnected():
          engine.cancel(request)
          return responses.Response(status_code=499)
        continue
      text.append(last.delta)
    if last.finish_reason == "error":
      raise ApiError(503, last.note, kind="server_error")
    return shape.whole("".join(text), last)

  async def _events(http, request, updates, shape) -> AsyncIterator[str]:
    try:
      yield _sse(shape.chunk("", None, first=True))
      while True:
        update = await updates.get()
        if update.delta or update.done:
          yield _sse(shape.chunk(update.delta, update if update.done else None))
        if update.done:
          for index, text in enumerate(shape.texts("", update)[1:], start=1):  # superposed's other drafts
            yield _sse(shape.chunk(text, update, index=index))
          if shape.stream_usage:
            yield _sse(shape.usage_chunk(update))
          yield "data: [DONE]\n\n"
          return
    finally:  # the client went away (or the stream ended): a running request leaves its row
      if not request.cancelled:
        engine.cancel(request)

  return app


async def _json(http: fastapi.Request):
  raw = await http.body()
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise ApiError(400, f"the request body is not valid JSON: {err}") from None


def request_sampling(body, defaults: dict) -> SamplingConfig:
  """The request's sampling. What it leaves unset comes from the model's `generation.json` (`defaults`), as vLLM
  applies a model's generation config: its repetition penalty, and for a method that keeps them its distinct
  topics."""
  penalty = body.repetition_penalty
  if penalty is None:
    penalty = defaults.get("repetition_penalty", 1.0)
  topics = bool(defaults.get("distinct_topics")) and registry.METHODS[body.method].capabilities.distinct_topics
  return SamplingConfig(temperature=body.temperature, top_p=body.top_p, repetition_penalty=penalty,
                        distinct_topics=topics)


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


class _Shape:
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
