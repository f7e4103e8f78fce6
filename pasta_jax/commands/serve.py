"""`pasta serve`: the OpenAI-compatible server (pasta_jax/serve/) on uvicorn."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from pasta_jax.commands.method_flags import add_option_flags, apply_to_all
from pasta_jax.errors import PastaError
from pasta_jax.methods.registry import names

if TYPE_CHECKING:
  from pasta_jax.serve.access import HttpConfig


def add_serve_parser(subparsers) -> None:
  serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
  serve.add_argument("--model", default=None,
                     help="as `pasta generate --model` (default: the tuned PASTA adapter on the embedded 270M)")
  serve.add_argument("--host", default="127.0.0.1")
  serve.add_argument("--port", type=int, default=8000)
  serve.add_argument("--batch", type=int, default=8, help="rows per method batch (requests decoded together)")
  serve.add_argument("--pool", type=int, default=1024, help="KV slots per row: prompt + answer, tags included")
  serve.add_argument("--chunk", type=int, default=8, help="decode steps per device call between host visits")
  serve.add_argument("--first-chunk", type=int, default=2,
                     help="steps of a batch's chunk right after an admission (newcomers' first text streams sooner)")
  serve.add_argument("--chunk-seconds", type=float, default=0.5,
                     help="a chunk's steps are at most this over the batch's measured step time, so a request that "
                          "arrives mid-chunk waits about this long to be admitted (0: always --chunk steps)")
  serve.add_argument("--admit-wait", type=float, default=0.25,
                     help="seconds a burst of requests may take to arrive before the engine admits it in one prefill "
                          "(it admits as soon as none has arrived for 20 ms; 0: at once)")
  serve.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
  serve.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens a request may ask")
  serve.add_argument("--warmup", default="pasta,sequential",
                     help="methods compiled before the port opens, every batch load and prompt bucket up to "
                          "--warmup-prompt (comma list; 'none': compile on first use)")
  serve.add_argument("--warmup-prompt", type=int, default=64, help="the longest prompt (tokens) compiled ahead")
  serve.add_argument("--grace", type=float, default=10.0,
                     help="seconds running requests may finish after SIGTERM before they are cut")
  serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  serve.add_argument("--certify-head", action="store_true",
                     help="greedy requests choose from a narrow head copy (int8 on a CPU) certified against the "
                          "float32 head: the same tokens, a cheaper step where the head plan says (float32 only)")
  access = serve.add_argument_group("access and limits")
  access.add_argument("--api-key", default=None,
                      help="every route but /health needs `Authorization: Bearer KEY` (default: the environment "
                           "variable PASTA_API_KEY, which unlike a flag other users cannot read in `ps`; neither: no "
                           "key, and a warning when --host is beyond loopback)")
  access.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                      help="a browser origin (scheme://host[:port]) allowed to call the server, with CORS headers; "
                           "repeat it or give a comma list; '*': any. Default: none, so a request with an Origin "
                           "header (a browser page's) is refused 403: a page of another site cannot drive the server")
  access.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                      help="a Host name the server answers to (any port) besides loopback's (localhost, 127.0.0.1, "
                           "[::1]) and the --host address, which are answered with the served port; repeat it or "
                           "give a comma list; '*': any Host. Bound to 0.0.0.0 or ::, any IP address is answered too, "
                           "but a DNS name (the machine's own, a proxy's) only when listed here. Every other Host is "
                           "refused 403: a hostile page whose name resolves to this machine (DNS rebinding) is refused")
  access.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES",
                      help="the largest request body (bytes; larger: 413)")
  access.add_argument("--max-connections", type=int, default=256,
                      help="open connections at once (idle keep-alive ones included); past them: 503")
  access.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                      help="a non-streaming request not answered within this is cancelled and answered 504 (a "
                           "request's own `timeout` field may ask less); default: no limit")
  add_option_flags(serve)  # each sets that option of every served method that has it


def http_config(args: argparse.Namespace) -> HttpConfig:
  """The HTTP layer's settings from the flags (the key from PASTA_API_KEY when --api-key is not given)."""
  from pasta_jax.serve.access import HttpConfig

  def listed(values: list[str]) -> tuple[str, ...]:
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

  key = args.api_key if args.api_key is not None else (os.environ.get("PASTA_API_KEY") or None)
  try:
    return HttpConfig(api_key=key, allow_origins=listed(args.allow_origin), allow_hosts=listed(args.allow_host),
                      max_body=args.max_body, max_connections=args.max_connections,
                      request_timeout=args.request_timeout)
  except ValueError as err:
    raise PastaError(str(err)) from None


def run_serve(args: argparse.Namespace) -> int:
  from pasta_jax.model.load import GENERATION_FILE, generation_defaults, load_model
  from pasta_jax.serve.app import make_server
  from pasta_jax.serve.engine import Engine, ServeConfig

  try:
    methods = tuple(apply_to_all(names(serve=True), args).values())
    cfg = ServeConfig(batch=args.batch, pool_slots=args.pool, chunk_steps=args.chunk,
                      first_chunk_steps=args.first_chunk, chunk_seconds=args.chunk_seconds,
                      admit_wait_s=args.admit_wait,
                      max_queue=args.max_queue, max_tokens=args.max_tokens, dtype=args.dtype, methods=methods,
                      certify_head=args.certify_head)
  except ValueError as err:
    raise PastaError(str(err)) from None
  http = http_config(args)
  model = load_model(args.model)
  name = args.model or "pasta"  # the id clients name in `model` (GET /v1/models)
  print(f"pasta serve: [model: {model.describe()}]", flush=True)
  if said := ", ".join(f"{k} {v}" for k, v in generation_defaults(model).items()):
    print(f"pasta serve: a request that leaves them unset gets this model's {GENERATION_FILE}: {said}", flush=True)
  engine = Engine(model, cfg).start()
  methods = [] if args.warmup == "none" else [m.strip() for m in args.warmup.split(",") if m.strip()]
  for method in methods:
    if method not in names(serve=True):
      raise PastaError(f"--warmup: unknown or unserved method {method!r}; use one of {', '.join(names(serve=True))}")
  if methods:
    print(f"pasta serve: compiling {', '.join(methods)} (batch {cfg.batch}, pool {cfg.pool_slots}) ...", flush=True)
    engine.warm_up(methods, prompt_tokens=args.warmup_prompt)
  server = make_server(engine, name, host=args.host, port=args.port, grace_s=args.grace, http=http)
  print(f"pasta serve: {name} on http://{args.host}:{args.port}/v1; its threads, live: http://{args.host}:{args.port}/",
        flush=True)
  server.run()
  return 0
