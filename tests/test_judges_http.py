"""The endpoint client and the HTTP judge against a real HTTP server on loopback: logprobs, missing
logprobs, 429 with Retry-After, 5xx, timeouts, malformed JSON, persistent failure, other 4xx, the
rate limit, and a key that never shows in logs, reprs or errors. Sleeps are recorded, not slept."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pasta_jax.endpoint import MALFORMED_RETRIES, ChatClient, EndpointConfig, EndpointError
from pasta_jax.judges import CachedJudge, HttpJudge
from pasta_jax.judges.factory import VERDICTS_FILE, make_judge
from pasta_jax.judges.prompt import PROMPT_VERSION, parse_choice
from pasta_jax.model.runfiles import read_rows

KEY = "sk-secret-test-key-123"


def reply(text="A", logprobs=None, tokens=None) -> dict:
  """A chat-completions body; `logprobs` = the first token's alternatives; `tokens` = the token split."""
  choice = {"message": {"role": "assistant", "content": text}}
  if logprobs is not None:
    tokens = tokens or [text]
    content = [{"token": t, "logprob": 0.0, "top_logprobs": [{"token": t, "logprob": 0.0}]} for t in tokens]
    at = next((i for i, t in enumerate(tokens) if t.strip("[* ") in ("A", "B")), 0)
    content[at]["top_logprobs"] = [{"token": t, "logprob": lp} for t, lp in logprobs.items()]
    choice["logprobs"] = {"content": content}
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
    self.httpd.daemon_threads = True
    threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

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


def config_for(server, **kw) -> EndpointConfig:
  return EndpointConfig(base_url=server.url, model="judge-model", api_key=KEY, **{"timeout_s": 2.0, **kw})


def judge_for(server, sleeps, **kw) -> HttpJudge:
  config = config_for(server, **kw)
  return HttpJudge(config, ChatClient(config, sleep=sleeps.append))


# --- confidence ----------------------------------------------------------------------------------------
def test_confidence_from_logprobs(serve):
  server = serve((200, reply("A", {"A": math.log(0.7), " B": math.log(0.2), "C": math.log(0.1)}), {}, 0))
  verdict = judge_for(server, []).compare("q", "one", "two")
  assert verdict.p_first == pytest.approx(0.7 / 0.9)
  path, headers, body = server.requests[0]
  assert path == "/v1/chat/completions" and headers["Authorization"] == f"Bearer {KEY}"
  assert body["model"] == "judge-model" and body["logprobs"] is True and body["top_logprobs"] == 5
  assert body["temperature"] == 0 and "one" in body["messages"][1]["content"]


def test_letter_variants_add_up_and_brackets_are_skipped(serve):
  """' A' and 'A' are one letter; a reply opening with '[[' is read at the letter's token."""
  tops = {"A": math.log(0.3), " A": math.log(0.3), "B": math.log(0.2), "**": math.log(0.2)}
  server = serve((200, reply("[[A]]", tops, tokens=["[[", "A", "]]"]), {}, 0))
  assert judge_for(server, []).compare("q", "a", "b").p_first == pytest.approx(0.6 / 0.8)


def test_missing_logprobs_fall_back_to_the_letter(serve):
  server = serve((200, reply("[[B]]"), {}, 0), (200, reply("I cannot decide"), {}, 0),
                 (200, reply("Answer: A", {"The": 0.0}), {}, 0))
  judge = judge_for(server, [])
  first = judge.compare("q", "a", "b")
  assert first.p_first == 0.0 and "no logprobs" in first.raw
  tie = judge.compare("q", "a", "b")
  assert tie.p_first == 0.5 and "unparseable" in tie.raw
  assert judge.compare("q", "a", "b").p_first == 1.0


def test_an_endpoint_refusing_logprobs_is_asked_without(serve):
  server = serve((400, {"error": "logprobs are not supported"}, {}, 0), (200, reply("B"), {}, 0),
                 (200, reply("A"), {}, 0))
  judge = judge_for(server, [])
  assert judge.compare("q", "a", "b").p_first == 0.0 and judge.compare("q", "a", "b").p_first == 1.0
  assert [("logprobs" in body) for _, _, body in server.requests] == [True, False, False]


def test_judge_name_has_model_and_prompt_version(serve):
  server = serve()
  assert judge_for(server, []).name == f"http:judge-model:{PROMPT_VERSION}"


# --- retries -------------------------------------------------------------------------------------------
def test_429_honours_retry_after_then_succeeds(serve):
  sleeps = []
  server = serve((429, "slow down", {"Retry-After": "7"}, 0), (200, reply("A"), {}, 0))
  assert judge_for(server, sleeps).compare("q", "a", "b").p_first == 1.0
  assert sleeps == [7.0] and len(server.requests) == 2


def test_retry_after_as_a_date_and_capped(serve):
  sleeps = []
  soon = formatdate(time.time() + 30, usegmt=True)
  server = serve((429, "", {"Retry-After": soon}, 0), (503, "", {"Retry-After": "3600"}, 0), (200, reply("A"), {}, 0))
  judge_for(server, sleeps, max_backoff_s=60).compare("q", "a", "b")
  assert 25 <= sleeps[0] <= 31 and sleeps[1] == 60  # an hour's Retry-After cannot stall the run
  assert len(server.requests) == 3


def test_5xx_backs_off_exponentially_with_jitter(serve):
  sleeps = []
  server = serve((500, "oops", {}, 0), (503, "busy", {}, 0), (502, "gateway", {}, 0), (200, reply("B"), {}, 0))
  assert judge_for(server, sleeps, backoff_s=1.0).compare("q", "a", "b").p_first == 0.0
  assert len(sleeps) == 3 and len(server.requests) == 4
  for attempt, wait in enumerate(sleeps):  # 1, 2, 4 seconds, each jittered into [half, full]
    assert 0.5 * 2 ** attempt <= wait <= 2 ** attempt


def test_backoff_is_capped(serve):
  sleeps = []
  server = serve(*[(500, "", {}, 0)] * 5, (200, reply("A"), {}, 0))
  judge_for(server, sleeps, backoff_s=1.0, max_backoff_s=3.0).compare("q", "a", "b")
  assert len(sleeps) == 5 and max(sleeps) <= 3.0 and min(sleeps[2:]) >= 1.5


def test_timeout_is_retried(serve):
  sleeps = []
  server = serve((200, reply("A"), {}, 1.0), (200, reply("B"), {}, 0))
  assert judge_for(server, sleeps, timeout_s=0.3).compare("q", "a", "b").p_first == 0.0
  assert len(sleeps) == 1 and len(server.requests) == 2


def test_malformed_json_is_retried(serve):
  server = serve((200, b"{not json", {}, 0), (200, {"choices": []}, {}, 0), (200, reply("A"), {}, 0))
  sleeps = []
  assert judge_for(server, sleeps).compare("q", "a", "b").p_first == 1.0
  assert len(sleeps) == 2 and len(server.requests) == 3


def test_persistent_garbage_gives_up_sooner_than_max_retries(serve):
  server = serve(*[(200, {"nothing": 1}, {}, 0)] * 10)
  with pytest.raises(EndpointError, match=f"gave up after {MALFORMED_RETRIES + 1} attempts: malformed reply"):
    judge_for(server, [], max_retries=8).compare("q", "a", "b")
  assert len(server.requests) == MALFORMED_RETRIES + 1


def test_persistent_failure_gives_up_with_a_clear_error(serve, caplog):
  server = serve(*[(500, f"boom {KEY}", {}, 0)] * 4)
  sleeps = []
  with caplog.at_level(logging.DEBUG), pytest.raises(EndpointError, match="gave up after 4 attempts") as err:
    judge_for(server, sleeps, max_retries=3).compare("q", "a", "b")
  assert len(server.requests) == 4 and len(sleeps) == 3
  assert "boom ***" in str(err.value)  # the server echoed the key: redacted
  assert KEY not in caplog.text and KEY not in str(err.value) and "retry 3/3" in caplog.text


def test_other_4xx_fail_at_once(serve):
  server = serve((400, {"error": f"bad model, key {KEY}"}, {}, 0))
  with pytest.raises(EndpointError, match="HTTP 400.*bad model") as err:
    judge_for(server, []).compare("q", "a", "b")
  assert len(server.requests) == 1 and err.value.status == 400 and KEY not in str(err.value)


@pytest.mark.parametrize("status", [401, 404, 422])
def test_client_errors_are_not_retried(serve, status):
  server = serve((status, "no", {}, 0), (200, reply("A"), {}, 0))
  sleeps = []
  with pytest.raises(EndpointError, match=f"HTTP {status}"):
    judge_for(server, sleeps).compare("q", "a", "b")
  assert sleeps == [] and len(server.requests) == 1


def test_connection_refused_is_retried_then_named(caplog):
  config = EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m", api_key=KEY, timeout_s=0.5, max_retries=2)
  sleeps = []
  with caplog.at_level(logging.DEBUG), pytest.raises(EndpointError, match="gave up after 3 attempts: connection"):
    ChatClient(config, sleep=sleeps.append).complete([{"role": "user", "content": "hi"}])
  assert len(sleeps) == 2 and KEY not in caplog.text


def test_rate_limit_spaces_requests(serve):
  """60 requests per minute: starts one second apart, across threads (a fake clock, recorded sleeps)."""
  server = serve(*[(200, reply("A"), {}, 0)] * 4)
  sleeps, lock = [], threading.Lock()

  def sleep(s):
    with lock:
      sleeps.append(s)

  client = ChatClient(config_for(server, requests_per_minute=60), sleep=sleep, clock=lambda: 100.0)
  threads = [threading.Thread(target=client.complete, args=([{"role": "user", "content": "x"}],)) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(sleeps) == [1.0, 2.0, 3.0] and len(server.requests) == 4


# --- configuration and secrets -------------------------------------------------------------------------
def test_key_never_in_repr_logs_or_errors(caplog):
  config = EndpointConfig(base_url="http://127.0.0.1:9", model="m", api_key=KEY, timeout_s=0.2, max_retries=1)
  judge = HttpJudge(config, ChatClient(config, sleep=lambda s: None))
  for text in (repr(config), str(config), repr(judge), repr(judge.client), f"{config}"):
    assert KEY not in text
  assert "api_key=<set>" in repr(config)
  with caplog.at_level(logging.DEBUG), pytest.raises(EndpointError) as err:
    judge.compare("q", "a", "b")
  assert KEY not in caplog.text and KEY not in str(err.value)


def test_config_from_env(monkeypatch):
  monkeypatch.setenv("PASTA_JUDGE_BASE_URL", "https://x/v1/")
  monkeypatch.delenv("PASTA_JUDGE_MODEL", raising=False)
  with pytest.raises(EndpointError, match="set PASTA_JUDGE_MODEL"):
    EndpointConfig.from_env()
  monkeypatch.setenv("PASTA_JUDGE_MODEL", "gpt-x")
  monkeypatch.setenv("PASTA_JUDGE_API_KEY", KEY)
  config = EndpointConfig.from_env(timeout_s=5)
  assert (config.base_url, config.model, config.api_key, config.timeout_s) == ("https://x/v1", "gpt-x", KEY, 5)
  monkeypatch.delenv("PASTA_ANNOTATOR_BASE_URL", raising=False)
  monkeypatch.delenv("PASTA_ANNOTATOR_MODEL", raising=False)
  with pytest.raises(EndpointError, match="PASTA_ANNOTATOR_BASE_URL and PASTA_ANNOTATOR_MODEL"):
    EndpointConfig.from_env("PASTA_ANNOTATOR")


@pytest.mark.parametrize("field, value, message", [("base_url", "localhost:8000", "http://"),
                                                   ("timeout_s", 0, "timeout_s"),
                                                   ("max_retries", -1, "max_retries"),
                                                   ("requests_per_minute", 0, "requests_per_minute")])
def test_bad_config_is_named(field, value, message):
  with pytest.raises(EndpointError, match=message):
    EndpointConfig(**{"base_url": "http://x", "model": "m", field: value})


def test_make_judge_http_from_env(serve, monkeypatch, tmp_path):
  """`pasta eval --judge http`: env config, a cached HTTP judge writing verdicts under --out."""
  server = serve((200, reply("A", {"A": math.log(0.9), "B": math.log(0.1)}), {}, 0))
  monkeypatch.setenv("PASTA_JUDGE_BASE_URL", server.url)
  monkeypatch.setenv("PASTA_JUDGE_MODEL", "judge-model")
  monkeypatch.setenv("PASTA_JUDGE_API_KEY", KEY)
  for spec in ("http", "auto"):
    judge, note = make_judge(spec, tmp_path, load_model=lambda path: pytest.fail("an HTTP judge loads no model"))
    assert isinstance(judge, CachedJudge) and isinstance(judge.inner, HttpJudge) and note == ""
  assert judge.compare("q", "a", "b").p_first == pytest.approx(0.9)
  assert judge.compare("q", "a", "b").p_first == pytest.approx(0.9) and len(server.requests) == 1
  rows = list(read_rows(tmp_path / VERDICTS_FILE))
  assert len(rows) == 1 and KEY not in (tmp_path / VERDICTS_FILE).read_text()


@pytest.mark.parametrize("text, letter", [
    ("A", "A"), ("[[B]]", "B"), ("Answer: A", "A"), ("b.", "B"), ("**B**", "B"), ("Verdict: [[A]]", "A"),
    ("B\nReason: shorter", "B"), ("Overall, B is better.", "B"), ("The better answer is B.", "B"),
    ("A or B", None), ("neither", None), ("[[A]] then [[B]]", None), ("A good answer would be short.", None),
    ("The answer is a tricky one", None), ("", None)])
def test_parse_choice(text, letter):
  assert parse_choice(text) == letter
