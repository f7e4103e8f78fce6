"""`pasta serve`'s HTTP face: an OpenAI-compatible FastAPI app over the `Engine`.

  POST /v1/completions, /v1/chat/completions   (server-sent events with `stream: true`)
  GET  /v1/models, /health, /metrics
  GET  /pasta/methods                            (the served methods and limits, for the page)
  GET  /                                         (a page that streams an answer thread by thread: serve/page/)

The page's files are the one thing served without the API key (a browser navigating to a page cannot send it; they
hold nothing secret): the page asks for the key and sends it with its API calls. Its stream asks `pasta_threads`
(`serve/shapes.py`), so each thread's text fills its own column as the thread writes.

Every failure is an OpenAI-style error body with its status: 400 for bad input (naming the field; a body that is
not a JSON object, not UTF-8, too deep or holding a lone surrogate included), 401 without the API key, 403 for a
Host or Origin this server does not answer, 404 for an unknown model, 413 for a body over `HttpConfig.max_body`,
415 for a POST that is not JSON, 429 with Retry-After when the queue is full, 503 while shutting down or after an
engine failure, 504 when a request's deadline passes. Past `max_connections` open connections uvicorn answers 503.
A request the engine ends with an error is answered with the status the engine gives it (a stream: with an error
event, then `[DONE]`). A client that disconnects is cancelled: its row is freed at the next chunk.

Who may call, and how much they may send: `serve/access.py` (`HttpConfig`). The response shapes: `serve/shapes.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator
from importlib import resources

import fastapi
import uvicorn
from fastapi import responses
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.tokenizing import chat_text
from pasta_jax.errors import PastaError
from pasta_jax.methods import Pasta, registry
from pasta_jax.model.load import generation_defaults
from pasta_jax.serve import protocol
from pasta_jax.serve.access import Access, Gate, HostRule, HttpConfig, is_loopback
from pasta_jax.serve.engine import Engine, QueueFull, Request, ShuttingDown, Update
from pasta_jax.serve.protocol import ApiError, ChatBody, CompletionBody
from pasta_jax.serve.shapes import Shape, sse

DEFAULT_HTTP = HttpConfig()  # no key, no other origins or hosts, 1 MiB bodies, 256 connections
POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there
# How long an idle keep-alive connection stays open. Longer than clients' own pool expiry (httpx, and so the
# `openai` client: 5 s), so the client always drops an idle connection first: at uvicorn's default (also 5 s) a
# client could reuse a connection the server was closing that instant and get "connection reset by peer".
KEEP_ALIVE_S = 75
# The page's files: path -> (file in serve/page/, media type). A fixed list: no path from a request reaches the disk.
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/page/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/page/style.css": ("style.css", "text/css; charset=utf-8")}
# The page runs only its own script and style and talks only to this server, so injected markup could do nothing.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# No token of the served tokenizers spans more than this many characters (Gemma 3's longest pieces are runs of 31
# spaces, newlines or tabs), so a prompt of more than pool_slots * this many characters cannot fit a row's pool:
# it is refused before it is tokenized (tokenizing a megabyte takes a while, even off the event loop).
MAX_CHARS_PER_TOKEN = 32


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
                grace_s: float = 10.0, http: HttpConfig = DEFAULT_HTTP) -> GracefulServer:
  """uvicorn over `create_app`, answering the Host names `HostRule.serving` gives for `host`:`port`. Warns (stderr)
  when it listens beyond loopback without an API key."""
  if not is_loopback(host) and http.api_key is None:
    print(f"pasta serve: warning: listening on {host} (beyond this machine) without an API key: anyone who can "
          "reach the port can use the server; set --api-key or PASTA_API_KEY", file=sys.stderr, flush=True)
  app = create_app(engine, model_name, grace_s, http, hosts=HostRule.serving(host, port, http.allow_hosts))
  # uvicorn refuses a request once the open connections (the requester's included) reach its limit: + 1 lets
  # `max_connections` of them in
  config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=5, limit_concurrency=http.max_connections + 1)
  return GracefulServer(config, engine, grace_s)


def create_app(engine: Engine, model_name: str, grace_s: float = 10.0, http: HttpConfig = DEFAULT_HTTP,
               hosts: HostRule | None = None) -> fastapi.FastAPI:
  """The app over a started engine; its shutdown stops the engine (a backstop: `GracefulServer` does it first).
  `hosts`: the Host headers it answers (None: any; `make_server` gives the rule for its address)."""

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
  max_prompt_chars = engine.cfg.pool_slots * MAX_CHARS_PER_TOKEN
  # the middleware, innermost first: key, Content-Type and body size; CORS headers (and preflights) for allowed
  # origins; Host and Origin
  app.add_middleware(AccessButPage, http=http)
  if http.allow_origins:
    app.add_middleware(CORSMiddleware, allow_origins=list(http.allow_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])
  app.add_middleware(Gate, hosts=hosts, origins=http.allow_origins)

  @app.exception_handler(ApiError)
  async def api_error(_, err: ApiError):
    return responses.JSONResponse(err.body(), status_code=err.status, headers=err.headers)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def validation_error(_, err):
    return responses.JSONResponse(ApiError(400, str(err)).body(), status_code=400)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_, err: StarletteHTTPException):  # an unknown route (404) or method (405)
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return responses.JSONResponse(ApiError(err.status_code, str(err.detail), kind=kind).body(),
                                  status_code=err.status_code, headers=err.headers)

  @app.exception_handler(Exception)
  async def crashed(_, err: Exception):  # a bug: still an error body (uvicorn logs the traceback)
    return responses.JSONResponse(ApiError(500, f"server error: {type(err).__name__}", kind="server_error").body(),
                                  status_code=500)

  @app.get("/health")
  async def health():
    state = engine.health()
    if state["status"] in ("failed", "stalled"):
      raise ApiError(503, state.get("reason") or f"the engine is {state['status']}", kind="server_error")
    return {**state, "model": model_name}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "pasta_jax"}]}

  @app.get("/metrics")
  async def metrics():
    return responses.Response(engine.metrics.text(), media_type="text/plain; version=0.0.4")

  @app.get("/pasta/methods")
  async def methods():
    served = []
    for name in registry.names(serve=True):
      cls = registry.METHODS[name]
      caps = cls.capabilities
      served.append({"name": name, "summary": cls.summary, "streams": caps.stream, "samples": caps.sample})
    return {"model": model_name, "default": default_method, "methods": served, "max_tokens": engine.cfg.max_tokens,
            "default_max_tokens": engine.cfg.default_max_tokens}

  page = page_files()
  for path, (content, media_type) in page.items():
    app.add_api_route(path, lambda content=content, media_type=media_type: responses.Response(
        content, media_type=media_type, headers=PAGE_HEADERS), methods=["GET"], include_in_schema=False)

  @app.post("/v1/completions")
  async def completions(client: fastapi.Request):
    body = protocol.parse_body(CompletionBody, await _json(client), default_method)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
      raise ApiError(400, "prompt: give one prompt per request", param="prompt")
    if not prompts[0]:
      raise ApiError(400, "prompt: empty prompt", param="prompt")
    _check_model(body)
    _check_length(len(prompts[0]), "prompt")
    ids = await asyncio.to_thread(engine.model.tokenizer.encode, prompts[0], add_bos=True)
    return await _serve(client, body, ids, chat=False, question=prompts[0])

  @app.post("/v1/chat/completions")
  async def chat_completions(client: fastapi.Request):
    body = protocol.parse_body(ChatBody, await _json(client), default_method)
    _check_model(body)
    _check_length(sum(len(m.content) for m in body.messages), "messages")
    question = protocol.sot_question(body)
    tokenizer = engine.model.tokenizer

    def tokenize() -> list[int]:
      text = protocol.chat_prompt_text(body.messages, lambda t: chat_text(tokenizer, t))
      return tokenizer.encode(text, add_bos=True)

    return await _serve(client, body, await asyncio.to_thread(tokenize), chat=True, question=question)

  def _check_model(body) -> None:
    if body.model not in (None, model_name):
      raise ApiError(404, f"model: this server serves {model_name!r}, not {body.model!r}", param="model",
                     kind="not_found_error")

  def _check_length(chars: int, param: str) -> None:
    if chars > max_prompt_chars:
      raise ApiError(400, f"{param}: {chars} characters cannot fit the pool of {engine.cfg.pool_slots} slots per "
                     f"request (at most {MAX_CHARS_PER_TOKEN} characters a token)", param=param)

  def _timeout(body) -> float | None:
    """The request's deadline in seconds: its own `timeout`, at most the server's; streams have none."""
    if body.timeout is not None:
      if body.stream:
        raise ApiError(400, "timeout: only for non-streaming requests (a stream's client sees its progress and "
                       "can hang up)", param="timeout")
      if http.request_timeout is not None and body.timeout > http.request_timeout:
        raise ApiError(400, f"timeout: at most the server's {http.request_timeout:g} s", param="timeout")
      return body.timeout
    return None if body.stream else http.request_timeout

  async def _serve(client: fastapi.Request, body, ids: list[int], chat: bool, question: str | None = None):
    updates: asyncio.Queue[Update] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or engine.cfg.default_max_tokens
    method = engine.method_named(body.method)
    if body.n > method.max_choices:
      raise ApiError(400, f"n: method {method.name!r} here writes {method.max_choices} drafts; ask for at most that "
                     "many", param="n")
    timeout = _timeout(body)
    if body.pasta_threads and not body.stream:
      raise ApiError(400, "pasta_threads: only for streaming requests (stream: true); a whole answer's threads come "
                     "with return_trace", param="pasta_threads")

    def sink(update: Update) -> None:  # called from the engine thread
      with contextlib.suppress(RuntimeError):  # the event loop already closed (the server is gone)
        loop.call_soon_threadsafe(updates.put_nowait, update)

    request = Request(ids=ids, method=method, max_tokens=max_tokens, sampling=request_sampling(body, defaults),
                      sink=sink, question=question, chat=chat, thread_progress=body.pasta_threads)
    try:
      await asyncio.to_thread(engine.submit, request)  # (SoT's skeleton prompt is tokenized there)
    except QueueFull as err:
      raise ApiError(429, str(err), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ShuttingDown as err:
      raise ApiError(503, str(err), kind="server_error") from None
    except PastaError as err:
      raise ApiError(400, str(err), param="max_tokens" if "max_tokens" in str(err) else "prompt") from None
    usage = body.stream_options is not None and body.stream_options.include_usage
    shape = Shape(request, model_name, chat, body.return_trace, len(ids), usage, body.n, threads=body.pasta_threads)
    if body.stream:
      return responses.StreamingResponse(_events(request, updates, shape), media_type="text/event-stream")
    return await _whole(client, request, updates, shape, timeout)

  async def _whole(client, request, updates, shape, timeout: float | None):
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    text, last = [], None
    while last is None or not last.done:
      wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - loop.time()))
      try:
        last = await asyncio.wait_for(updates.get(), wait)
      except asyncio.TimeoutError:
        if deadline is not None and loop.time() >= deadline:
          engine.cancel(request)
          raise ApiError(504, f"no answer within the request's deadline of {timeout:g} s; it was cancelled",
                         kind="server_error") from None
        if await client.is_disconnected():
          engine.cancel(request)
          return responses.Response(status_code=499)
        continue
      text.append(last.delta)
    if last.finish_reason == "error":
      raise engine_error(last)
    return shape.whole("".join(text), last)

  async def _events(request, updates, shape) -> AsyncIterator[str]:
    try:
      yield sse(shape.chunk("", None, first=True))
      while True:
        update = await updates.get()
        if update.done and update.finish_reason == "error":  # OpenAI's way mid-stream: an error event, then [DONE]
          if update.delta:
            yield sse(shape.chunk(update.delta, None))
          err = engine_error(update)
          yield sse(err.body(code=err.status))
          yield "data: [DONE]\n\n"
          return
        threads = shape.thread_events(update)
        if update.delta or update.done or threads:
          yield sse(shape.chunk(update.delta, update if update.done else None, threads=threads))
        if update.done:
          for index, text in enumerate(shape.texts("", update)[1:], start=1):  # superposed's other drafts
            yield sse(shape.chunk(text, update, index=index))
          if shape.stream_usage:
            yield sse(shape.usage_chunk(update))
          yield "data: [DONE]\n\n"
          return
    finally:  # the client went away (or the stream ended): a running request leaves its row
      if not request.cancelled:
        engine.cancel(request)

  return app


class AccessButPage:
  """`Access` (the key, Content-Type and body size) for every request but a GET of the page's files
  (`PAGE_FILES`): a browser fetches those by navigating, without the key. `Gate` still checks their Host."""

  def __init__(self, app, http: HttpConfig):
    self.app, self.access = app, Access(app, http=http)

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in PAGE_FILES:
      return await self.app(scope, receive, send)
    return await self.access(scope, receive, send)


def page_files() -> dict[str, tuple[bytes, str]]:
  """The page's files (path -> (content, media type)), read once: they ship in the package (serve/page/)."""
  folder = resources.files("pasta_jax.serve").joinpath("page")
  out = {}
  for path, (name, media_type) in PAGE_FILES.items():
    try:
      out[path] = (folder.joinpath(name).read_bytes(), media_type)
    except FileNotFoundError:
      raise PastaError(f"the page's file {name} is missing from {folder}: reinstall pasta_jax (its package data "
                       "holds serve/page/)") from None
  return out


def engine_error(update: Update) -> ApiError:
  """The answer to a request the engine ended with an error, at the status it gives (400: it cannot be served
  here; 500: the server failed running it; 504: its deadline passed)."""
  status = getattr(update, "status", 500)
  kind = "server_error" if status >= 500 else "invalid_request_error"
  return ApiError(status, update.note or "the request failed", kind=kind)


async def _json(client: fastapi.Request):
  """The body as JSON, strictly: UTF-8, no NaN or Infinity; anything else is a 400, never a 500 (an integer past
  Python's 4,300 digits raises ValueError, a deeply nested one RecursionError)."""
  raw = await client.body()
  try:
    return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
  except UnicodeDecodeError as err:
    raise ApiError(400, f"the request body is not UTF-8: {err}") from None
  except RecursionError:
    raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
  except ValueError as err:  # json.JSONDecodeError, an integer too long to convert
    raise ApiError(400, f"the request body is not valid JSON: {err}") from None


def _no_constant(name: str):
  raise ValueError(f"{name} is not JSON")


def request_sampling(body, defaults: dict) -> SamplingConfig:
  """The request's sampling. What it leaves unset comes from the model's `generation.json` (`defaults`), as vLLM
  applies a model's generation config: its repetition penalty, and for a method that keeps them its distinct
  topics. A sampled request without a seed gets a fresh one (OpenAI's: each such request draws anew); a greedy one
  seed 0, which it never reads."""
  penalty = body.repetition_penalty
  if penalty is None:
    penalty = defaults.get("repetition_penalty", 1.0)
  topics = bool(defaults.get("distinct_topics")) and registry.METHODS[body.method].capabilities.distinct_topics
  seed = body.seed
  if seed is None:
    seed = secrets.randbits(32) if body.temperature > 0 else 0
  return SamplingConfig(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, repetition_penalty=penalty,
                        seed=seed, distinct_topics=topics, fork_bias=body.fork_bias,
                        max_topic_tokens=body.max_topic_tokens)


