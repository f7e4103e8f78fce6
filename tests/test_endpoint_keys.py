"""The endpoint's API key stays home, and judges keep no verdict that is no probability.

Against real HTTP servers on loopback: a redirect to another host is refused before the key travels
(and urllib's own redirect-following opener would not carry it either); plain http:// carries a key
only to loopback unless explicitly allowed; NaN / inf / missing logprobs are retried as malformed
replies and, when they persist, fail the pair without a cached verdict."""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pasta_jax.cli import main
from pasta_jax.data import llm_annotator
from pasta_jax.endpoint import MALFORMED_RETRIES, ChatClient, EndpointConfig, EndpointError
from pasta_jax.errors import PastaError
from pasta_jax.judges import CachedJudge, HttpJudge, Verdict, factory
from pasta_jax.judges.factory import VERDICTS_FILE, make_judge
from pasta_jax.model.runfiles import read_rows
from tests.test_judges_http import KEY, reply

MESSAGES = [{"role": "user", "content": "hi"}]


class Host:
  """A loopback server on `address` answering any GET or POST from a script of (status, body, headers),
  and recording (method, path, headers) of every request."""

  def __init__(self, address: str, script=()):
    self.script, self.requests = list(script), []
    outer = self

    class Handler(BaseHTTPRequestHandler):
      def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        outer.requests.append((self.command, self.path, dict(self.headers)))
        status, body, headers = outer.script.pop(0) if outer.script else (200, reply("A"), {})
        payload = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

      do_GET = do_POST = answer

      def log_message(self, *args):
        pass

    self.httpd = ThreadingHTTPServer((address, 0), Handler)
    self.httpd.daemon_threads = True
    threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

  @property
  def origin(self) -> str:
    host, port = self.httpd.server_address[:2]
    return f"http://{host}:{port}"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def host():
  hosts = []

  def start(address="127.0.0.1", *script):
    hosts.append(Host(address, script))
    return hosts[-1]

  yield start
  for h in hosts:
    h.close()


def client_for(origin: str, sleeps=None, **kw) -> ChatClient:
  config = EndpointConfig(base_url=f"{origin}/v1", model="m", api_key=KEY, timeout_s=2.0, **kw)
  return ChatClient(config, sleep=(sleeps if sleeps is not None else []).append)


# --- redirects ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_is_refused_naming_both(host, code):
  """127.0.0.2 is another host on the same machine: it must never see the request, let alone the key."""
  elsewhere = host("127.0.0.2")
  home = host("127.0.0.1", (code, "", {"Location": f"{elsewhere.origin}/steal"}))
  sleeps = []
  with pytest.raises(EndpointError, match="redirect") as err:
    client_for(home.origin, sleeps).complete(MESSAGES)
  assert home.origin in str(err.value) and elsewhere.origin in str(err.value) and KEY not in str(err.value)
  assert err.value.status == code and sleeps == [] and len(home.requests) == 1  # not retried
  assert elsewhere.requests == []
  assert home.requests[0][2]["Authorization"] == f"Bearer {KEY}"  # the configured host does get it


def test_a_same_origin_redirect_is_refused_too(host):
  """Only the configured URL is asked: a redirect, even to the same host, means base_url is wrong."""
  home = host("127.0.0.1", (302, "", {"Location": "/v2/chat/completions"}))
  with pytest.raises(EndpointError, match="redirected .*set base_url"):
    client_for(home.origin).complete(MESSAGES)
  assert len(home.requests) == 1


def test_a_redirect_following_opener_does_not_carry_the_key(host):
  """Defence in depth: handed urllib's stock opener, which follows redirects, the key still stays home."""
  elsewhere = host("127.0.0.2")
  home = host("127.0.0.1", (302, "", {"Location": f"{elsewhere.origin}/steal"}))
  config = EndpointConfig(base_url=f"{home.origin}/v1", model="m", api_key=KEY, timeout_s=2.0)
  ChatClient(config, urlopen=urllib.request.urlopen, sleep=lambda s: None).complete(MESSAGES)
  assert home.requests[0][2]["Authorization"] == f"Bearer {KEY}"
  [(method, path, headers)] = elsewhere.requests
  assert path == "/steal" and "Authorization" not in headers and KEY not in json.dumps(headers)


def test_the_annotator_stops_at_a_redirect(host, tmp_path):
  """Every request would be redirected alike: the annotator stops, writing no answer off as refused."""
  elsewhere = host("127.0.0.2")
  home = host("127.0.0.1", *[(307, "", {"Location": f"{elsewhere.origin}/v1/chat/completions"})] * 3)
  records = [{"id": f"r{i}", "instruction": "Tips?", "output": "Sleep well. Eat well."} for i in range(3)]
  with pytest.raises(EndpointError, match="redirected"):
    llm_annotator.annotate_file(records, client_for(home.origin), tmp_path / "p.jsonl", len, concurrency=1,
                                progress=False)
  assert list(read_rows(tmp_path / "p.jsonl")) == [] and elsewhere.requests == []


# --- plain http ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["http://judge.example.com/v1", "http://10.0.0.7:8000/v1", "http://127.0.0.1.nip.io/v1",
                                 "http://localhost@judge.example.com/v1", "http://[::2]:8000/v1"])
def test_a_key_over_plain_http_to_another_machine_is_refused(url):
  with pytest.raises(EndpointError) as err:
    EndpointConfig(base_url=url, model="m", api_key=KEY)
  assert url in str(err.value) and "--allow-http-key" in str(err.value) and "allow_insecure_key" in str(err.value)
  assert KEY not in str(err.value)
  EndpointConfig(base_url=url, model="m", api_key=KEY, allow_insecure_key=True)  # explicitly allowed
  EndpointConfig(base_url=url, model="m")  # no key, nothing to leak
  EndpointConfig(base_url=url.replace("http://", "https://"), model="m", api_key=KEY)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://127.8.9.10/v1", "http://localhost:11434/v1",
                                 "http://LOCALHOST/v1", "http://[::1]:8000/v1"])
def test_a_key_over_plain_http_to_loopback_is_fine(url):
  EndpointConfig(base_url=url, model="m", api_key=KEY)


def test_pasta_eval_names_the_url_and_the_flag(tmp_path, monkeypatch, capsys):
  """`pasta eval --judge http` refuses before any model loads, in one line; --allow-http-key lets it through."""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"id": "1", "instruction": "Hi", "output": "Hello."}) + "\n")
  monkeypatch.setenv("PASTA_JUDGE_BASE_URL", "http://judge.example.com/v1")
  monkeypatch.setenv("PASTA_JUDGE_MODEL", "judge")
  monkeypatch.setenv("PASTA_JUDGE_API_KEY", KEY)
  argv = ["eval", "--prompts", str(prompts), "--judge", "http", "--out", str(tmp_path / "run")]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "http://judge.example.com/v1" in err and "--allow-http-key" in err
  assert KEY not in err
  made = []

  def stop_after_the_judge(spec, out, load, **kw):
    made.append(make_judge(spec, out, load, **kw))
    raise PastaError("stop here")

  monkeypatch.setattr(factory, "make_judge", stop_after_the_judge)
  assert main([*argv, "--allow-http-key"]) == 2 and "stop here" in capsys.readouterr().err
  assert isinstance(made[0][0].inner, HttpJudge)


def test_pasta_annotate_names_the_url_and_the_flag(tmp_path, monkeypatch, capsys):
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"id": "1", "instruction": "Hi", "output": "Hello."}) + "\n")
  monkeypatch.setenv("PASTA_ANNOTATOR_BASE_URL", "http://annotator.example.com/v1")
  monkeypatch.setenv("PASTA_ANNOTATOR_MODEL", "annotator")
  monkeypatch.setenv("PASTA_ANNOTATOR_API_KEY", KEY)
  argv = ["annotate", str(data), "--with", "llm", "--out", str(tmp_path / "o.jsonl")]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "http://annotator.example.com/v1" in err and "--allow-http-key" in err
  clients, real = [], llm_annotator.client_from_env

  def stop_after_the_client(**kw):  # before the tokenizer loads: this test stays fast
    clients.append(real(**kw))
    raise PastaError("stop here")

  monkeypatch.setattr(llm_annotator, "client_from_env", stop_after_the_client)
  assert main([*argv, "--allow-http-key"]) == 2 and "stop here" in capsys.readouterr().err
  assert clients[0].config.allow_insecure_key and clients[0].config.api_key == KEY


# --- logprobs that are no numbers ---------------------------------------------------------------------
def with_logprob(value, letter="A") -> dict:
  """A reply whose letter token has alternatives {letter: value, other: log 0.2}; `...` drops the field."""
  body = reply(letter, {letter: 0.0, "B" if letter == "A" else "A": math.log(0.2)})
  alt = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]
  if value is ...:
    del alt["logprob"]
  else:
    alt["logprob"] = value
  return body


BAD_LOGPROBS = [math.nan, math.inf, None, ..., "-0.1", True]


@pytest.mark.parametrize("bad", BAD_LOGPROBS, ids=["nan", "inf", "null", "missing", "string", "bool"])
def test_a_bad_logprob_is_retried_and_the_good_reply_used(host, tmp_path, bad):
  home = host("127.0.0.1", (200, with_logprob(bad), {}), (200, with_logprob(math.log(0.6)), {}))
  sleeps = []
  judge = CachedJudge(HttpJudge(client_for(home.origin).config, client_for(home.origin, sleeps)),
                      tmp_path / VERDICTS_FILE)
  assert judge.compare("q", "a", "b").p_first == pytest.approx(0.6 / 0.8)
  assert len(home.requests) == 2 and len(sleeps) == 1
  [row] = read_rows(tmp_path / VERDICTS_FILE)
  assert row["p_first"] == pytest.approx(0.75)


def test_always_nan_gives_up_and_caches_nothing(host, tmp_path):
  home = host("127.0.0.1", *[(200, with_logprob(math.nan), {})] * 10)
  judge = CachedJudge(HttpJudge(client_for(home.origin).config, client_for(home.origin, max_retries=8)),
                      tmp_path / VERDICTS_FILE)
  with pytest.raises(EndpointError, match=f"gave up after {MALFORMED_RETRIES + 1} attempts: malformed reply "
                                          r"\(logprob nan for token 'A'\)"):
    judge.compare("q", "a", "b")
  assert len(home.requests) == MALFORMED_RETRIES + 1 and len(judge) == 0
  assert not (tmp_path / VERDICTS_FILE).exists() or list(read_rows(tmp_path / VERDICTS_FILE)) == []


def test_minus_infinity_is_a_probability_of_zero(host):
  """-inf is a valid logprob (the letter cannot be next); only NaN and +inf are no logprob at all."""
  home = host("127.0.0.1", (200, with_logprob(-math.inf, letter="B"), {}))
  assert HttpJudge(client_for(home.origin).config, client_for(home.origin)).compare("q", "a", "b").p_first == 1.0
  assert len(home.requests) == 1


def test_huge_logprobs_do_not_overflow(host):
  """A server sending logprobs far above 0 (nonsense, but finite) still gives a probability, not OverflowError."""
  body = reply("A", {"A": 1000.0, "B": 999.0})
  home = host("127.0.0.1", (200, body, {}))
  p = HttpJudge(client_for(home.origin).config, client_for(home.origin)).compare("q", "a", "b").p_first
  assert p == pytest.approx(1 / (1 + math.exp(-1)))


class Fixed:
  name = "fixed"

  def __init__(self, p):
    self.p, self.calls = p, 0

  def compare(self, instruction, first, second):
    self.calls += 1
    return Verdict(self.p, "raw")


@pytest.mark.parametrize("p", [math.nan, math.inf, -0.5, 1.5])
def test_the_cache_keeps_no_verdict_that_is_no_probability(tmp_path, p):
  path = tmp_path / VERDICTS_FILE
  judge = CachedJudge(Fixed(p), path)
  with pytest.raises(PastaError, match="not a probability"):
    judge.compare("q", "a", "b")
  assert len(judge) == 0 and list(read_rows(path)) == []
  good = CachedJudge(Fixed(0.25), path)  # the pair was not marked as judged: it is asked again
  assert good.compare("q", "a", "b").p_first == 0.25 and good.inner.calls == 1


def test_a_nan_row_left_by_an_older_run_is_judged_again(tmp_path):
  path = tmp_path / VERDICTS_FILE
  first = CachedJudge(Fixed(0.25), path)
  first.compare("q", "a", "b")
  [row] = read_rows(path)
  path.write_text(json.dumps({**row, "p_first": math.nan}) + "\n")  # as an unguarded run would have written
  again = CachedJudge(Fixed(0.75), path)
  assert len(again) == 0 and again.compare("q", "a", "b").p_first == 0.75 and again.inner.calls == 1
