"""`pasta serve`'s HTTP layer alone: limits, input checks, keys, origins and Host names, /health, the engine's
errors and deadlines, and the flags that set them. The engine here never decodes (no compile): a submitted request
is answered at once with a scripted update, or waits until it is cancelled. tests/test_serve.py serves real answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.model.config import get_config
from pasta_jax.model.load import LoadedModel
from pasta_jax.serve.access import HostRule, HttpConfig
from pasta_jax.serve.app import make_server
from pasta_jax.serve.engine import Engine, ServeConfig, Update
from tests.tiny import CharTokenizer

NAME = "tiny"
KEY = "sesame"
POOL = 256
CFG = ServeConfig(batch=2, pool_slots=POOL, max_queue=64, max_tokens=48)
GOOD_ORIGIN = "http://good.example"
HTTP = HttpConfig(api_key=KEY, allow_origins=(GOOD_ORIGIN,), allow_hosts=("pasta.example",), max_body=64 * 1024,
                  request_timeout=30)
ANSWER = [Update("ok", True, "stop")]


class CountingTokenizer(CharTokenizer):
  """The tiny model's tokenizer, counting its calls and taking `delay` seconds over each (a slow tokenizer)."""

  def __init__(self):
    self.calls, self.delay, self.started = 0, 0.0, threading.Event()

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    self.calls += 1
    self.started.set()
    time.sleep(self.delay)
    return super().encode(text, add_bos)


class Scripted(Engine):
  """An engine that never decodes: a submitted request gets `reply`'s updates at once (None: it is queued and waits,
  as no engine thread runs, until it is cancelled). `submitted` keeps every request."""

  def __init__(self):
    # a model with no weights: nothing here decodes (tiny_model's random init costs seconds)
    super().__init__(LoadedModel(get_config("tiny-gemma3"), {}, CountingTokenizer(), "random:none"), CFG)
    self.reply: list[Update] | None = ANSWER
    self.submitted = []

  def submit(self, request) -> None:
    if self.reply is None:
      super().submit(request)
    else:
      self.check(request.ids, request.max_tokens)
      for update in self.reply:
        request.sink(update)
    self.submitted.append(request)


@contextlib.contextmanager
def serving(http: HttpConfig = HTTP):
  """Yields (base_url, engine, port): a `Scripted` engine behind `make_server` on a free loopback port."""
  engine = Scripted()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = make_server(engine, NAME, port=port, grace_s=0, http=http)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started:
    assert time.time() < deadline and thread.is_alive(), "the server did not start"
    time.sleep(0.02)
  try:
    yield f"http://127.0.0.1:{port}", engine, port
  finally:
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def served():
  with serving() as running:
    yield running


@pytest.fixture
def engine(served):
  engine = served[1]
  yield engine
  engine.reply, engine.model.tokenizer.delay = ANSWER, 0.0


@pytest.fixture(scope="module")
def keyless(served):
  with httpx.Client(base_url=served[0], timeout=10) as client:
    yield client


@pytest.fixture(scope="module")
def http(served):
  with httpx.Client(base_url=served[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
    yield client


def post(http: httpx.Client, body, path: str = "/v1/completions", **headers) -> httpx.Response:
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  return http.post(path, content=content, headers={"Content-Type": "application/json", **headers})


def error_of(reply: httpx.Response, status: int, kind: str = "invalid_request_error") -> dict:
  assert reply.status_code == status, reply.text
  error = reply.json()["error"]
  assert error["type"] == kind and error["message"], error
  return error


def raw_exchange(port: int, head: str, *parts: bytes) -> bytes:
  """Sends a request head and body parts on a raw connection and, without ending the body, reads the answer until
  the server closes the connection (a refusal closes it: the rest of the body is never read)."""
  with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
    conn.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
    for part in parts:
      conn.sendall(part)
    answer = b""
    while piece := conn.recv(65536):
      answer += piece
    return answer


def head(port: int, *lines: str) -> str:
  return "\n".join(["POST /v1/completions HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {KEY}",
                    "Content-Type: application/json", *lines, ""])


# --- limits and input checks ----------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_from_its_content_length_unread(served, http):
  """Refused from Content-Length alone: the server answers while the body has not even started."""
  port = served[2]
  answer = raw_exchange(port, head(port, f"Content-Length: {10 ** 9}"))
  assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
  assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
  error_of(post(http, {"prompt": "x" * (64 * 1024)}), 413)


def test_a_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit(served, http):
  """A chunked body (no Content-Length) is refused once what was read passes the limit, before its end; one under
  the limit is served."""
  port = served[2]
  chunk = b"a" * (40 * 1024)
  piece = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
  answer = raw_exchange(port, head(port, "Transfer-Encoding: chunked"), piece, piece)  # 80 KiB, and no last chunk
  assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
  assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
  body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
  reply = http.post("/v1/completions", content=iter([body[:5], body[5:]]), headers={"Content-Type": "application/json"})
  assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"


def test_an_oversize_body_still_being_sent_gets_its_413_not_a_reset(served, http):
  """A body over the limit (but within a few times it) that the client goes on sending after the server has
  decided: the server reads the rest and drops it before it answers, so the client reads the 413 and its error
  body rather than a reset (a server that closes with the body unread makes its kernel reset the connection).
  Streamed in pieces on a raw connection with its Content-Length, and by httpx, whole and chunked."""
  port = served[2]
  body = b"x" * (3 * HTTP.max_body)
  piece = 16 * 1024
  with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
    conn.sendall(head(port, f"Content-Length: {len(body)}").replace("\n", "\r\n").encode() + b"\r\n")
    for start in range(0, len(body), piece):
      conn.sendall(body[start:start + piece])
      time.sleep(0.002)  # the server decides from the Content-Length while the client is still sending
    answer = b""
    while chunk := conn.recv(65536):
      answer += chunk
  assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
  assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
  error_of(post(http, body), 413)
  pieces = iter([body[start:start + piece] for start in range(0, len(body), piece)])
  error_of(http.post("/v1/completions", content=pieces, headers={"Content-Type": "application/json"}), 413)


def test_tokenizing_runs_off_the_event_loop(http, engine):
  """While a slow tokenization runs, the server still answers /health at once."""
  tokenizer = engine.model.tokenizer
  tokenizer.delay = 1.0
  tokenizer.started.clear()
  replies = []
  asking = threading.Thread(target=lambda: replies.append(post(http, {"prompt": "slow to tokenize"})))
  asking.start()
  assert tokenizer.started.wait(5)
  begin = time.perf_counter()
  health = http.get("/health")
  took = time.perf_counter() - begin
  asking.join(10)
  assert health.status_code == 200 and took < 0.5, took
  assert replies[0].status_code == 200


def test_a_prompt_too_long_for_the_pool_is_refused_before_it_is_tokenized(http, engine):
  tokenizer, bound = engine.model.tokenizer, POOL * 32
  calls = tokenizer.calls
  assert error_of(post(http, {"prompt": "y" * (bound + 1)}), 400)["param"] == "prompt"
  messages = [{"role": "user", "content": "y" * (bound // 2)}, {"role": "assistant", "content": "z"},
              {"role": "user", "content": "y" * (bound // 2)}]
  assert error_of(post(http, {"messages": messages}, "/v1/chat/completions"), 400)["param"] == "messages"
  assert tokenizer.calls == calls
  assert error_of(post(http, {"prompt": "y" * bound}), 400)["param"] == "prompt"  # within the bound: the engine's
  assert tokenizer.calls == calls + 1


@pytest.mark.parametrize("raw, param, path", [
    pytest.param(b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", None, None, id="int-past-4300-digits"),
    pytest.param(b'{"prompt": "a", "logprobs": ' + b"[" * 20000 + b"]" * 20000 + b"}", None, None, id="deep"),
    pytest.param(b'{"prompt": "a \\ud800"}', "prompt", None, id="surrogate"),  # json.loads takes it
    pytest.param(b'{"prompt": ["\\udfff"]}', "prompt.0", None, id="surrogate-in-list"),
    pytest.param(b'{"prompt": "a", "\\ud800": 1}', None, None, id="surrogate-key"),
    pytest.param(b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages.0.content",
                 "/v1/chat/completions", id="surrogate-in-chat"),
    pytest.param(b'{"prompt": "\xff\xfe"}', None, None, id="not-utf8"),
    pytest.param(b'["a list"]', None, None, id="list"),
    pytest.param(b'"a string"', None, None, id="string"),
    pytest.param(b"null", None, None, id="null"),
    pytest.param(b'{"prompt": "a", "temperature": NaN}', None, None, id="nan"),
    pytest.param(b'{"prompt": "a", "temperature": 1e400}', "temperature", None, id="inf"),
])
def test_a_malformed_body_is_400_with_an_error_body(http, engine, raw, param, path):
  submitted = len(engine.submitted)
  assert error_of(post(http, raw, path or "/v1/completions"), 400)["param"] == param
  assert len(engine.submitted) == submitted


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "7"}, "max_tokens"),
    ({"max_tokens": 7.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"temperature": "1"}, "temperature"),
    ({"return_trace": "true"}, "return_trace"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt.1"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"seed": "7"}, "seed"),
    ({"top_k": 2.0}, "top_k"),
])
def test_types_are_strict_and_a_wrong_one_names_its_field(http, fields, param):
  assert error_of(post(http, {"prompt": "hi", **fields}), 400)["param"] == param


def test_an_integer_is_a_float_and_a_chat_message_is_strict_too(http, engine):
  assert post(http, {"prompt": "hi", "temperature": 1, "top_p": 1}).status_code == 200
  assert engine.submitted[-1].sampling.temperature == 1.0
  bad = {"messages": [{"role": "user", "content": 5}]}
  assert error_of(post(http, bad, "/v1/chat/completions"), 400)["param"] == "messages.0.content"


def test_connections_past_max_connections_get_503():
  with serving(HttpConfig(max_connections=2)) as (_, _, port):
    request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    first, second = (socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2))
    with first, second:
      for conn in (first, second):  # two open (keep-alive) connections are served
        conn.sendall(request)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
      with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
        third.sendall(request)
        assert third.recv(4096).startswith(b"HTTP/1.1 503")


def test_top_k_and_seed_reach_the_requests_sampling(http, engine):
  """vLLM's top_k and OpenAI's seed are per request: they reach the engine's SamplingConfig. A sampled request
  without a seed draws its own; a greedy one needs none."""
  body = {"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 2 ** 32 - 1}
  assert post(http, body).status_code == 200
  assert engine.submitted[-1].sampling == SamplingConfig(temperature=0.5, top_p=0.9, top_k=5, seed=2 ** 32 - 1)
  seeds = set()
  for _ in range(2):
    assert post(http, {"prompt": "hi", "temperature": 0.5}).status_code == 200
    seeds.add(engine.submitted[-1].sampling.seed)
  assert len(seeds) == 2
  assert post(http, {"prompt": "hi"}).status_code == 200 and engine.submitted[-1].sampling == SamplingConfig()
  for fields, param in (({"seed": 2 ** 32}, "seed"), ({"seed": -1}, "seed"), ({"top_k": -1}, "top_k")):
    assert error_of(post(http, {"prompt": "hi", **fields}), 400)["param"] == param


# --- keys, origins and Host names ---------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_api_key(keyless, engine):
  submitted = len(engine.submitted)
  for key in (None, "wrong", KEY + "x", KEY[:-1], f"Basic {KEY}"):
    auth = {} if key is None else {"Authorization": key if key.startswith("Basic") else f"Bearer {key}"}
    reply = post(keyless, b'{"prompt": "hi"}', **auth)
    assert error_of(reply, 401, "authentication_error") and reply.headers["www-authenticate"] == "Bearer"
  assert len(engine.submitted) == submitted
  for path in ("/v1/models", "/metrics", "/no/such/route"):
    error_of(keyless.get(path), 401, "authentication_error")
  assert keyless.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
  assert post(keyless, b'{"prompt": "hi"}', Authorization=f"Bearer {KEY}").status_code == 200
  assert keyless.get("/health").status_code == 200


def test_an_origin_not_allowed_is_refused_before_anything_runs(http, engine):
  """A cross-site page's POST (text/plain needs no preflight) is refused, not executed; an allowed origin gets
  CORS headers and its preflight is answered."""
  submitted = len(engine.submitted)
  body = b'{"prompt": "hi"}'
  for kind in ("text/plain", "application/json"):
    reply = http.post("/v1/completions", content=body, headers={"Origin": "http://evil.example", "Content-Type": kind})
    error_of(reply, 403, "permission_error")
  error_of(http.get("/v1/models", headers={"Origin": "null"}), 403, "permission_error")
  assert len(engine.submitted) == submitted
  allowed = post(http, body, Origin=GOOD_ORIGIN)
  assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == GOOD_ORIGIN
  preflight = http.options("/v1/completions", headers={"Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "authorization,content-type"})
  assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_a_post_that_is_not_json_is_415(http, engine):
  submitted = len(engine.submitted)
  for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
    headers = {"Content-Type": kind} if kind else {}
    reply = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    error_of(reply, 415)
  assert len(engine.submitted) == submitted
  assert http.post("/v1/completions", content=b'{"prompt": "hi"}',
                   headers={"Content-Type": "Application/JSON; charset=utf-8"}).status_code == 200


def test_a_host_the_server_is_not_known_by_is_refused(served, http):
  """DNS rebinding: a hostile name resolving to 127.0.0.1 still sends its own name as Host."""
  port = served[2]
  for host in (f"evil.example:{port}", "evil.example", f"localhost:{port + 1}", f"localhost.evil.example:{port}",
               f"127.0.0.1:{port}:1", f"[::1:{port}", f"192.168.7.7:{port}"):
    error_of(http.get("/v1/models", headers={"Host": host}), 403, "permission_error")
  for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LOCALHOST.:{port}", "127.0.0.1",
               "pasta.example:443", f"127.0.0.2:{port}"):
    assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_the_host_rule_of_a_server_bound_to_every_interface():
  """Bound to 0.0.0.0 or ::, any IP address is answered (clients reach the server by its addresses; rebinding
  names a host), a DNS name only when allowed; '*' answers any Host."""
  rule = HostRule.serving("0.0.0.0", 8000, ("box.lan",))
  assert all(rule.allows(h) for h in ("192.168.1.5:8000", "10.0.0.1", "[fe80::1]:8000", "localhost:8000", "box.lan"))
  assert not any(rule.allows(h) for h in ("evil.example:8000", "mybox:8000", "192.168.1.5:9000"))
  bound = HostRule.serving("192.168.1.5", 8000)
  assert bound.allows("192.168.1.5:8000") and not bound.allows("10.0.0.1:8000")
  assert HostRule.serving("::", 8000, ("*",)) is None


def test_listening_beyond_loopback_without_a_key_warns(capsys, monkeypatch):
  # uvicorn's logging set-up would keep the streams it finds (capsys's, closed after the test)
  monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
  for host, key, warns in (("0.0.0.0", None, True), ("192.168.1.5", None, True), ("0.0.0.0", KEY, False),
                           ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False)):
    make_server(Scripted(), NAME, host=host, port=0, http=HttpConfig(api_key=key))
    assert ("without an API key" in capsys.readouterr().err) == warns, (host, key)


# --- /health, the engine's errors, deadlines -------------------------------------------------------------------------
def test_health_reports_the_engines_own_state(http, engine, monkeypatch):
  state = http.get("/health").json()
  assert state["status"] == "ok" and state["model"] == NAME and {"reason", "running", "queued"} <= state.keys()
  for status in ("stalled", "failed"):
    monkeypatch.setattr(engine, "health", lambda s=status: {"status": s, "reason": f"the engine is {s}: why",
                                                             "running": 1, "queued": 0})
    assert "why" in error_of(http.get("/health"), 503, "server_error")["message"]
  monkeypatch.setattr(engine, "health", lambda: {"status": "draining", "reason": "", "running": 1, "queued": 0})
  assert http.get("/health").json()["status"] == "draining"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (500, "server_error"),
                                          (504, "server_error")])
def test_an_engine_error_is_answered_with_its_status(http, engine, status, kind):
  """Whole: that status and an error body. Streamed: an error event, then [DONE]."""
  engine.reply = [Update("", True, "error", note="not served: why" if status == 400 else "it broke", status=status)]
  error = error_of(post(http, {"prompt": "hi"}), status, kind)
  assert error["message"] in ("not served: why", "it broke")
  with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as reply:
    assert reply.status_code == 200
    events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]" and "choices" in json.loads(events[0])
  last = json.loads(events[-2])["error"]
  assert last["type"] == kind and last["code"] == status and last["message"] == error["message"]


def test_a_request_past_its_deadline_is_cancelled_and_answered_504(http, engine):
  engine.reply = None  # it waits
  begin = time.perf_counter()
  error = error_of(post(http, {"prompt": "hi", "timeout": 0.3}), 504, "server_error")
  assert "deadline" in error["message"] and time.perf_counter() - begin < 2
  assert engine.submitted[-1].cancelled
  assert error_of(post(http, {"prompt": "hi", "timeout": 31}), 400)["param"] == "timeout"  # over the server's 30
  assert error_of(post(http, {"prompt": "hi", "timeout": 0}), 400)["param"] == "timeout"
  assert error_of(post(http, {"prompt": "hi", "timeout": 1, "stream": True}), 400)["param"] == "timeout"


def test_the_servers_request_timeout_bounds_every_whole_request():
  with serving(HttpConfig(request_timeout=0.3)) as (url, engine, _):
    engine.reply = None
    error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10), 504, "server_error")
    assert engine.submitted[-1].cancelled


# --- the flags -----------------------------------------------------------------------------------------------------
def test_the_flags_reach_the_server(monkeypatch):
  import argparse
  from types import SimpleNamespace

  from pasta_jax.commands.serve import add_serve_parser, run_serve
  from pasta_jax.model import load
  from pasta_jax.serve import app, engine

  parser = argparse.ArgumentParser()  # `pasta serve`'s own (the whole CLI's imports the data pipeline: seconds)
  add_serve_parser(parser.add_subparsers(dest="command"))
  made = []
  model = SimpleNamespace(source="random:tiny", describe=lambda: "tiny")  # (a real one's describe hashes the GGUF)
  monkeypatch.setattr(load, "load_model", lambda path: model)
  monkeypatch.setattr(engine, "Engine", lambda model, cfg: SimpleNamespace(start=lambda: "engine"))
  monkeypatch.setattr(app, "make_server", lambda *a, **kw: made.append(kw) or SimpleNamespace(run=lambda: None))
  monkeypatch.setenv("PASTA_API_KEY", "from-env")
  flags = ["serve", "--warmup", "none", "--allow-origin", "http://a.example,http://b.example", "--allow-origin",
           "http://c.example/", "--allow-host", "box.lan", "--max-body", "1000", "--max-connections", "3",
           "--request-timeout", "5"]
  assert run_serve(parser.parse_args(flags)) == 0
  assert made[-1]["http"] == HttpConfig(api_key="from-env", allow_origins=("http://a.example", "http://b.example",
                                                                           "http://c.example"),
                                        allow_hosts=("box.lan",), max_body=1000, max_connections=3,
                                        request_timeout=5.0)
  assert run_serve(parser.parse_args(["serve", "--warmup", "none", "--api-key", "flag"])) == 0
  assert made[-1]["http"].api_key == "flag"
  monkeypatch.setenv("PASTA_API_KEY", "")
  assert run_serve(parser.parse_args(["serve", "--warmup", "none"])) == 0
  assert made[-1]["http"] == HttpConfig() and made[-1]["http"].api_key is None
