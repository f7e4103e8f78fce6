"""The HTTP judge's protocol handling against a real HTTP server on loopback: logprobs, missing
logprobs, 429 with Retry-After, 5xx, timeouts, malformed JSON, persistent failure, other 4xx, and a
key that never shows in logs, reprs or errors."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pasta_jax.endpoint import ChatClient, EndpointConfig, EndpointError
from pasta_jax.judges import HttpJudge
from pasta_jax.judges.prompt import parse_choice

KEY = "sk-secret-test-key-123"


def reply(text="A", logprobs=None) -> dict:
  choice = {"message": {"role": "assistant", "content": text}}
  if logprobs is not None:
    choice["logprobs"] = {"content": [{"token": text, "logprob": 0.0,
                                       "top_logprobs": [{"token": t, "logprob": lp} for t, lp in logprobs.items()]}]}
  return {"choices": [choice]}


class Server:
  """Serves a script of responses, one per request: (status, body, headers, delay_s)."""

  def __init__(self, script):
    self.script, self.requests = list(script), []
    outer = self

    class Handler(BaseHTTPRequestHandler):
      def do_POST(self):
        length = int(self.headers["Content-Length"])
        outer.requests.append((self.path, dict(self.headers), json.loads(self.rfile.read(length))))
        status, body, headers, delay = outer.script.pop(0) if outer.script else (500, "script ended", {}, 0)
        time.sleep(delay)
        payload = body if isinstance(body, bytes) else (json.dumps(body) if isinstance(body, dict) else body).encode()
        try:
          self.send_response(status)
          for k, v in headers.items():
            self.send_header(k, v)
          self.send_header("Content-Length", str(len(payload)))
          self.end_headers()
          self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
          pass  # the client timed out and left

      def log_message(self, *args):
        pass

    self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def serve():
  servers = []

  def start(*script):
    servers.append(Server(script))
    return servers[-1]

  yield start
  for s in servers:
    s.close()


def judge_for(server, sleeps, **kw):
  config = EndpointConfig(base_url=server.url, model="judge-model", api_key=KEY, **{"timeout_s": 2.0, **kw})
  return HttpJudge(config, ChatClient(config, sleep=sleeps.append))


def test_confidence_from_logprobs(serve):
  server = serve((200, reply("A", {"A": math.log(0.7), " B": math.log(0.2), "C": math.log(0.1)}), {}, 0))
  verdict = judge_for(server, []).compare("q", "one", "two")
  assert verdict.p_first == pytest.approx(0.7 / 0.9)
  path, headers, body = server.requests[0]
  assert path == "/v1/chat/completions" and headers["Authorization"] == f"Bearer {KEY}"
  assert body["model"] == "judge-model" and body["logprobs"] is True and "one" in body["messages"][1]["content"]


def test_missing_logprobs_fall_back_to_the_letter(serve):
  server = serve((200, reply("[[B]]"), {}, 0), (200, reply("I cannot decide"), {}, 0))
  judge = judge_for(server, [])
  first = judge.compare("q", "a", "b")
  assert first.p_first == 0.0 and "no logprobs" in first.raw
  assert judge.compare("q", "a", "b").p_first == 0.5


def test_429_honours_retry_after_then_succeeds(serve):
  sleeps = []
  server = serve((429, "slow down", {"Retry-After": "7"}, 0), (200, reply("A"), {}, 0))
  assert judge_for(server, sleeps).compare("q", "a", "b").p_first == 1.0
  assert sleeps == [7.0] and len(server.requests) == 2


def test_5xx_backs_off_exponentially(serve):
  sleeps = []
  server = serve((500, "oops", {}, 0), (503, "busy", {}, 0), (502, "gateway", {}, 0), (200, reply("B"), {}, 0))
  assert judge_for(server, sleeps, backoff_s=1.0).compare("q", "a", "b").p_first == 0.0
  assert len(sleeps) == 3 and len(server.requests) == 4
  for attempt, wait in enumerate(sleeps):  # 1, 2, 4 seconds, each jittered into [half, full]
    assert 0.5 * 2 ** attempt <= wait <= 2 ** attempt


def test_timeout_is_retried(serve):
  sleeps = []
  server = serve((200, reply("A"), {}, 1.5), (200, reply("B"), {}, 0))
  assert judge_for(server, sleeps, timeout_s=0.5).compare("q", "a", "b").p_first == 0.0
  assert len(sleeps) == 1 and len(server.requests) == 2


def test_malformed_json_is_retried(serve):
  server = serve((200, b"{not json", {}, 0), (200, {"choices": []}, {}, 0), (200, reply("A"), {}, 0))
  sleeps = []
  assert judge_for(server, sleeps).compare("q", "a", "b").p_first == 1.0
  assert len(sleeps) == 2


def test_persistent_failure_gives_up_with_a_clear_error(serve, caplog):
  server = serve(*[(500, f"boom {KEY}", {}, 0)] * 4)
  sleeps = []
  with caplog.at_level(logging.WARNING), pytest.raises(EndpointError, match="gave up after 4 attempts") as err:
    judge_for(server, sleeps, max_retries=3).compare("q", "a", "b")
  assert len(server.requests) == 4 and len(sleeps) == 3
  assert "boom ***" in str(err.value) and KEY not in caplog.text and KEY not in str(err.value)  # echoed key redacted


def test_other_4xx_fail_at_once(serve):
  server = serve((400, {"error": "bad model"}, {}, 0))
  with pytest.raises(EndpointError, match="HTTP 400.*bad model"):
    judge_for(server, []).compare("q", "a", "b")
  assert len(server.requests) == 1


def test_key_never_in_repr_logs_or_errors(serve, caplog, monkeypatch):
  config = EndpointConfig(base_url="http://127.0.0.1:9", model="m", api_key=KEY, timeout_s=0.2, max_retries=1)
  assert KEY not in repr(config) and KEY not in str(config)
  with caplog.at_level(logging.DEBUG), pytest.raises(EndpointError) as err:
    HttpJudge(config, ChatClient(config, sleep=lambda s: None)).compare("q", "a", "b")
  assert KEY not in caplog.text and KEY not in str(err.value)
  monkeypatch.setenv("PASTA_JUDGE_BASE_URL", "http://x")
  monkeypatch.delenv("PASTA_JUDGE_MODEL", raising=False)
  with pytest.raises(EndpointError, match="set PASTA_JUDGE_MODEL"):
    EndpointConfig.from_env()


@pytest.mark.parametrize("text, letter", [("A", "A"), ("[[B]]", "B"), ("Answer: A", "A"), ("b.", "B"),
                                          ("A or B", None), ("neither", None)])
def test_parse_choice(text, letter):
  assert parse_choice(text) == letter
