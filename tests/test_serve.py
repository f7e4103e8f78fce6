"""`pasta serve`: the real server (uvicorn on 127.0.0.1) over a tiny random Gemma, driven by the official
`openai` client and by raw HTTP. Answers equal `pasta_jax.generate` on the same prompts (greedy), streamed or
not, for every served method; bad input gets its status and OpenAI-style body; a full queue, a client that
disconnects and a shutdown behave as documented."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from pasta_jax.baselines.sot import SkeletonOfThought, SotConfig
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.speculation import Drafter
from pasta_jax.methods import Medusa, Pasta, PastaTrees, Propd, Sequential, Sot, Superposed, generate, resolve
from pasta_jax.model import medusa
from pasta_jax.serve.app import make_server
from pasta_jax.serve.engine import Engine, ServeConfig
from tests.marks import HEAVY
from tests.tiny import tiny_model

MODEL = tiny_model()
NAME = "tiny"
# Medusa heads that start as the tied output head (so the tiny model's loops get real multi-token paths)
HEADS = Drafter(medusa.init_heads(medusa.MedusaConfig(num_heads=2), MODEL.params["params"]["embedder"]),
                medusa.MedusaConfig(num_heads=2), np.full((2, 8), 0.3, np.float32))
CFG = ServeConfig(batch=4, pool_slots=512, chunk_steps=4, max_queue=8, max_tokens=48, default_max_tokens=24,
                  methods=(Medusa(heads=HEADS, tree_size=4), Propd(heads=HEADS, tree_size=4),
                           PastaTrees(heads=HEADS, tree_size=4), Superposed(drafts=3, ngram=None)))
SERVED = {m.name: m for m in CFG.methods}
PROMPTS = ["Tell me a tea.", "x", "Why blue sky?", "abc def"]  # one prompt bucket (few compiles)


@contextlib.contextmanager
def running_server(engine: Engine, grace_s: float = 5.0):
  """Yields (base_url, uvicorn server) for `engine` behind the app, on a free loopback port."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = make_server(engine, NAME, port=port, grace_s=grace_s)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 60
  while not server.started:
    assert time.time() < deadline and thread.is_alive(), "the server did not start"
    time.sleep(0.05)
  try:
    yield f"http://127.0.0.1:{port}", server
  finally:
    server.should_exit = True
    thread.join(timeout=60)


@pytest.fixture(scope="module")
def server():
  engine = Engine(MODEL, CFG).start()
  with running_server(engine) as (url, _):
    yield url, engine


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def reference(prompt: str, method: str, max_tokens: int, chat: bool) -> str:
  value = SERVED.get(method) or resolve(method)
  if isinstance(value, Sot):  # the tiny model writes no outline: SoT answers plainly (tests/test_serve_sot.py expands)
    config = SotConfig(chat=chat, point_tokens=max_tokens, answer_tokens=max_tokens, lanes=value.lanes)
    return SkeletonOfThought(MODEL, config).run(prompt).text
  if isinstance(value, Propd):  # greedy tree decoding is lossless: plain greedy's tokens, whatever sizes it picks
    value = Sequential()
  if isinstance(value, PastaTrees):  # and PASTA's, with a tree on every thread
    value = Pasta(lanes=value.lanes)
  return generate(MODEL, [prompt], value, max_new_tokens=max_tokens, chat=chat)[0].text


# The served path is one for every method: sequential, PASTA and SoT (its two stages) run here; the others, each
# equal to generate through the same hand-out, with PASTA_HEAVY_TESTS=1 (about 110 s on 2 cores).
@pytest.mark.parametrize("method", ["sequential", "pasta", "sot"] + [
    pytest.param(name, marks=HEAVY) for name in ("apar", "pasta-v0", "medusa", "propd", "pasta+medusa")])
def test_completions_equal_generate_streamed_or_not(client, method):
  """Four prompts at once (they share the batch), each streamed and whole, against generate alone."""
  max_tokens = 20
  results: dict = {}

  def ask(i: int, stream: bool):
    kw = dict(model=NAME, prompt=PROMPTS[i], max_tokens=max_tokens, extra_body={"method": method})
    if stream:
      chunks = list(client.completions.create(stream=True, **kw))
      text = "".join(c.choices[0].text for c in chunks if c.choices)
      results[i, stream] = (text, chunks[-1].choices[0].finish_reason)
    else:
      done = client.completions.create(**kw)
      results[i, stream] = (done.choices[0].text, done.choices[0].finish_reason)

  threads = [threading.Thread(target=ask, args=(i, s)) for i in range(len(PROMPTS)) for s in (True, False)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  for i, prompt in enumerate(PROMPTS):
    want = reference(prompt, method, max_tokens, chat=False)
    assert results[i, True][0] == want, (method, i, "streamed")
    assert results[i, False][0] == want, (method, i, "whole")
    assert results[i, True][1] == results[i, False][1] in ("stop", "length")


def test_chat_streams_pasta_and_returns_the_trace(client):
  stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=24, stream=True, extra_body={"method": "pasta"})
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == reference(PROMPTS[0], "pasta", 24, chat=True)
  whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}],
                                         max_tokens=24, extra_body={"method": "pasta", "return_trace": True})
  assert whole.choices[0].message.content == text
  extra = whole.model_extra["pasta"]
  assert extra["method"] == "pasta" and extra["threads"][0]["thread"] == 0
  assert whole.usage.completion_tokens == generate(MODEL, [PROMPTS[0]], Pasta(), max_new_tokens=24)[0].content_tokens


def test_repetition_penalty_reaches_the_decoder(client):
  """vLLM's extra field: the answer equals generate's under the same penalty, and differs from the plain one."""
  done = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=20,
                                   extra_body={"method": "sequential", "repetition_penalty": 3.0})
  want = generate(MODEL, [PROMPTS[1]], Sequential(), max_new_tokens=20, chat=False,
                  sampling=SamplingConfig(repetition_penalty=3.0))[0].text
  assert done.choices[0].text == want != reference(PROMPTS[1], "sequential", 20, chat=False)


def test_a_request_that_sets_no_penalty_or_method_gets_the_models_generation_json(tmp_path):
  """As vLLM applies a model's generation config: the folder's penalty and method fill a request's unset fields;
  a request's own value wins."""
  (tmp_path / "generation.json").write_text('{"repetition_penalty": 3.0, "method": "sequential"}')
  engine = Engine(MODEL._replace(source=str(tmp_path)), ServeConfig(batch=1, pool_slots=256, max_tokens=20)).start()
  penalized = generate(MODEL, [PROMPTS[1]], Sequential(), max_new_tokens=20, chat=False,
                       sampling=SamplingConfig(repetition_penalty=3.0))[0].text
  with running_server(engine) as (url, _), httpx.Client(timeout=120) as http:
    def ask(**fields) -> str:
      body = {"prompt": PROMPTS[1], "max_tokens": 20, "method": "sequential", **fields}
      return http.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]

    assert ask() == penalized != reference(PROMPTS[1], "sequential", 20, chat=False)
    assert ask(repetition_penalty=1.0) == reference(PROMPTS[1], "sequential", 20, chat=False)
    served = http.post(f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}).json()["pasta"]
    assert served["method"] == "sequential"  # the folder's, not the server's own default (pasta)


def test_request_sampling_fills_only_what_the_request_leaves_unset():
  from pasta_jax.serve.app import request_sampling
  from pasta_jax.serve.protocol import CompletionBody
  folder = {"repetition_penalty": 1.1, "distinct_topics": True}
  assert request_sampling(CompletionBody(prompt="x", method="pasta"), folder) == SamplingConfig(
      repetition_penalty=1.1, distinct_topics=True)
  own = CompletionBody(prompt="x", method="sequential", repetition_penalty=1.0, temperature=0.5, seed=3)
  assert request_sampling(own, folder) == SamplingConfig(temperature=0.5, seed=3)  # PASTA's topics rule only for pasta
  assert request_sampling(CompletionBody(prompt="x"), {}) == SamplingConfig()


def test_models_health_and_metrics(server, client):
  url, _ = server
  assert [m.id for m in client.models.list().data] == [NAME]
  assert httpx.get(f"{url}/health").json()["status"] == "ok"
  client.completions.create(model=NAME, prompt="hello", max_tokens=4, extra_body={"method": "sequential"})
  text = httpx.get(f"{url}/metrics").text
  for name in ("pasta_queue_length", "pasta_running_requests", "pasta_tokens_per_second",
               "pasta_time_to_first_token_seconds_bucket", 'pasta_requests_total{method="sequential"'):
    assert name in text, name


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(server):
  """httpx (and so `openai`) drops pooled connections idle for 5 s; the server must keep them longer, or a client
  reusing one just as the server closes it gets "connection reset by peer" (a CI failure at uvicorn's 5 s)."""
  url, _ = server
  host, port = url.removeprefix("http://").split(":")
  request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
  with socket.create_connection((host, int(port)), timeout=10) as conn:
    conn.sendall(request)
    assert b'"ok"' in conn.recv(4096)
    time.sleep(httpx.Limits().keepalive_expiry + 1.0)  # past the client's expiry: the server still holds it
    conn.sendall(request)
    assert b'"ok"' in conn.recv(4096)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": "hi", "colour": "red"}, 400, "colour"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 49}, 400, "max_tokens"),
    ({"prompt": "hi", "method": "telepathy"}, 400, "method"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "n": 4, "method": "superposed"}, 400, "n"),  # more choices than the server's 3 drafts
    ({"prompt": "hi", "seed": 2 ** 32}, 400, "seed"),
    ({"prompt": "hi", "max_tokens": "7"}, 400, "max_tokens"),  # strict: a string is not a number
    ({"prompt": "y" * 300}, 400, "prompt"),
    ({"prompt": "y" * 200, "method": "sot"}, 400, "prompt"),  # fits, but SoT's skeleton prompt does not
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
])
def test_bad_input_gets_its_status_and_an_openai_error_body(server, body, status, param):
  url, engine = server
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  reply = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
  assert reply.status_code == status, reply.text
  error = reply.json()["error"]
  assert error["message"] and error["type"] and error["param"] == param
  assert engine.error is None and httpx.get(f"{url}/health").json()["status"] == "ok"  # the server is untouched


def test_superposed_returns_its_best_n_drafts(client):
  """`n` choices are the best n of one decode's k drafts, as `generate` ranks them, streamed or whole."""
  want = generate(MODEL, [PROMPTS[0]], Superposed(ngram=None), max_new_tokens=12, chat=False)[0].drafts
  kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=12, extra_body={"method": "superposed"})
  whole = client.completions.create(n=2, **kw)
  assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == list(want[:2])
  streamed = collections.defaultdict(str)
  for chunk in client.completions.create(n=3, stream=True, **kw):
    for choice in chunk.choices:
      streamed[choice.index] += choice.text
  assert [streamed[i] for i in range(3)] == list(want) and len(set(want)) == 3


def test_sot_answers_one_question_not_a_conversation(server):
  url, engine = server
  turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
  reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": turns, "method": "sot"})
  assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
  assert engine.error is None


def test_a_full_queue_is_429_with_retry_after():
  engine = Engine(MODEL, ServeConfig(batch=1, pool_slots=256, max_queue=1, max_tokens=8))  # not started: no draining
  with running_server(engine, grace_s=1) as (url, _):
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions",
                                                       json={"prompt": "a", "stream": True}) as first:
      assert first.status_code == 200
      deadline = time.time() + 10
      while not engine.waiting and time.time() < deadline:
        time.sleep(0.02)
      second = http.post(f"{url}/v1/completions", json={"prompt": "b"})
      assert second.status_code == 429 and second.headers["retry-after"] == "1"
      assert second.json()["error"]["type"] == "rate_limit_error"


def test_a_client_that_disconnects_frees_its_row_for_the_next():
  engine = Engine(MODEL, ServeConfig(batch=1, pool_slots=256, chunk_steps=1, max_tokens=48)).start()
  with running_server(engine) as (url, _):
    body = {"prompt": "a long answer please", "stream": True, "max_tokens": 48, "method": "sequential"}
    with httpx.Client(timeout=60) as http:
      with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        next(reply.iter_lines())  # the first event, then hang up
      deadline = time.time() + 30
      while engine.running and time.time() < deadline:
        time.sleep(0.05)
      assert engine.running == 0  # the row was released at a chunk boundary
      after = http.post(f"{url}/v1/completions", json={"prompt": "next", "max_tokens": 6, "method": "sequential"})
      assert after.status_code == 200
      assert after.json()["choices"][0]["text"] == reference("next", "sequential", 6, False)
    assert 'outcome="cancelled"' in engine.metrics.text().decode()


def test_shutdown_cuts_running_requests_cleanly_and_returns():
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, chunk_steps=1, max_tokens=48)).start()
  events = []
  with running_server(engine, grace_s=0) as (url, server):
    with httpx.Client(timeout=60) as http:
      body = {"prompt": "keep going", "stream": True, "max_tokens": 48, "method": "sequential"}
      with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        events.append(next(lines))
        server.should_exit = True  # what SIGTERM does
        events += list(lines)
  data = [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]
  assert [e for e in events if e][-1] == "data: [DONE]"  # the stream ended, not the connection
  assert data[-1]["choices"][0]["finish_reason"] == "length" and "shut down" in data[-1]["pasta"]["note"]
  assert not engine.thread.is_alive()  # nothing hangs
  with pytest.raises(Exception, match="shutting down"):
    engine.submit(engine_request())


def engine_request():
  from pasta_jax.serve.engine import Request
  return Request(ids=[2, 100], method="sequential", max_tokens=4, sink=lambda u: None)


def test_a_failing_request_ends_alone_and_the_engine_serves_on():
  """A request whose client side raises (here: its sink) is ended with an error; its neighbours and later
  requests are served as usual."""
  import queue

  from pasta_jax.serve.engine import Request
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, chunk_steps=2, max_tokens=16)).start()
  try:
    def broken(update):
      raise RuntimeError("client went wrong")

    good: queue.Queue = queue.Queue()
    engine.submit(Request(ids=[2, 120, 130], method="sequential", max_tokens=12, sink=broken))
    engine.submit(Request(ids=[2] + [100 + ord(c) for c in "Tea?"], method="sequential", max_tokens=12, sink=good.put))
    updates = []
    while not updates or not updates[-1].done:
      updates.append(good.get(timeout=120))
    assert updates[-1].finish_reason in ("stop", "length") and engine.error is None and engine.thread.is_alive()
    assert "".join(u.delta for u in updates) == reference("Tea?", "sequential", 12, chat=False)
    assert 'outcome="error"' in engine.metrics.text().decode()
  finally:
    engine.stop(grace_s=0)


def test_a_newcomers_first_text_streams_after_a_short_chunk():
  """After an admission the batch runs `first_chunk_steps` steps, not `chunk_steps`: the newcomer's first text
  comes from its first few tokens, and the answer is still the one `generate` gives."""
  import queue

  from pasta_jax.serve.engine import Request
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, chunk_steps=8, first_chunk_steps=2,
                                     max_tokens=24)).start()
  try:
    updates: queue.Queue = queue.Queue()
    request = Request(ids=[2] + [100 + ord(c) for c in "Tea?"], method="sequential", max_tokens=24,
                      sink=lambda u: updates.put((u, request.counted)))
    engine.submit(request)
    seen = [updates.get(timeout=120)]
    while not seen[-1][0].done:
      seen.append(updates.get(timeout=120))
    first_tokens = next(counted for update, counted in seen if update.delta)
    assert first_tokens <= 1 + 2  # the prefill's token and the short chunk's two (a chunk of 8 would give 9)
    assert "".join(u.delta for u, _ in seen) == reference("Tea?", "sequential", 24, chat=False)
  finally:
    engine.stop(grace_s=0)


def test_a_chunk_lasts_about_chunk_seconds(monkeypatch):
  """A chunk's steps are at most `chunk_seconds` over the batch's last measured step time (a request that arrives
  mid-chunk waits for its end): with a target below any step's time, every chunk after the first is one step;
  with 0, every chunk is `chunk_steps` after the short first one; and so is every chunk of a full batch with nobody
  waiting (no newcomer can be admitted after it, and each chunk is a device call and a host visit). The answers
  stay `generate`'s."""
  import queue

  from pasta_jax.decode import batching
  from pasta_jax.serve.engine import Request
  chunks = []
  run = batching.RowBatch.run
  monkeypatch.setattr(batching.RowBatch, "run", lambda self, steps: (chunks.append(steps), run(self, steps)))
  want = reference("Tea?", "sequential", 24, chat=False)
  for rows, seconds, later in ((2, 1e-6, {1}), (2, 0.0, {8}), (1, 1e-6, {8})):
    chunks.clear()
    engine = Engine(MODEL, ServeConfig(batch=rows, pool_slots=256, chunk_steps=8, first_chunk_steps=4,
                                       chunk_seconds=seconds, max_tokens=24)).start()
    try:
      done: queue.Queue = queue.Queue()
      engine.submit(Request(ids=[2] + [100 + ord(c) for c in "Tea?"], method="sequential", max_tokens=24,
                            sink=done.put))
      updates = [done.get(timeout=300)]
      while not updates[-1].done:
        updates.append(done.get(timeout=300))
    finally:
      engine.stop(grace_s=0)
    assert "".join(u.delta for u in updates) == want
    assert chunks[0] == 4 and set(chunks[1:]) == later, (seconds, chunks)
    assert f'pasta_chunks_total{{length="short"}} {sum(c < 8 for c in chunks)}.0' in engine.metrics.text().decode()


@pytest.mark.parametrize("method", ["pasta", "propd"])
def test_a_certified_head_serves_the_float32_answers(method):
  """`certify_head`: greedy batches choose through the certified bfloat16 head and answer exactly as the float32
  `generate` does; a sampled request's batch keeps the float32 head."""
  import queue

  from pasta_jax.serve.engine import Request
  cfg = dataclasses.replace(CFG, batch=2, max_tokens=16, default_max_tokens=16, certify_head=True)
  engine = Engine(MODEL, cfg).start()
  try:
    done: queue.Queue = queue.Queue()
    prompts = PROMPTS[:2]
    for i, prompt in enumerate(prompts):
      ids = MODEL.tokenizer.encode(prompt, add_bos=True)
      engine.submit(Request(ids=ids, method=method, max_tokens=16, sink=lambda u, i=i: done.put((i, u))))
    texts = collections.defaultdict(str)
    finished = 0
    while finished < len(prompts):
      i, update = done.get(timeout=300)
      texts[i] += update.delta
      finished += update.done
    assert [texts[i] for i in range(len(prompts))] == [reference(p, method, 16, chat=False) for p in prompts]
    batches = {key: batch.prep.cfg.certify_head for key, batch in engine.batches.items()}
    assert batches and all(batches.values()), batches
    assert not engine.certifies(method, SamplingConfig(temperature=0.7))
  finally:
    engine.stop(grace_s=0)


def test_certify_head_is_refused_for_a_bfloat16_model():
  with pytest.raises(ValueError, match="float32"):
    ServeConfig(dtype="bfloat16", certify_head=True)
