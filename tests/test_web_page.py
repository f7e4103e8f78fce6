"""`pasta serve`'s threads page (`serve/page/`, GET /) and the stream extension it reads (`pasta_threads`).

Without a browser: the page's files are served without the API key and under a strict content policy, the methods
endpoint lists the served methods, `pasta_threads` is a streaming request's opt-in (a stream that did not ask sees
no new field), and the page's own origin may call the API while other origins still may not (the HTTP layer alone:
tests/test_serve_http.py's scripted engine).

In Debian's Chromium, driven by Selenium: the real server over the tiny random Gemma, its logits bent so that it
writes PASTA answers (promises whose forks write text), answers a prompt typed into the page; at least two thread
columns fill as the stream goes, and the composed answer is exactly `generate`'s for the same prompt, method and
sampling. Skipped where Chromium, its driver or Selenium is missing (CI installs them: .ci/run)."""

from __future__ import annotations

import functools
import json
import os
import tempfile

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.thread_text import ThreadText
from pasta_jax.methods import generate, registry
from pasta_jax.serve.engine import Engine, ServeConfig, Update
from tests.test_serve_http import KEY, error_of, post, serving
from tests.tiny import TEXT_BASE, CharTokenizer, biased_model_fn, tiny_model

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1000")
PROMPT = "List two things."
SEED, MAX_TOKENS = 3, 40  # a seed under which the bent tiny model forks three times, each fork writing text


# --- the HTTP side (no browser) -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
  with serving() as running:
    yield running


def test_the_page_is_served_without_the_key_under_a_strict_content_policy(served):
  url, _, _ = served
  with httpx.Client(base_url=url, timeout=10) as keyless:
    page = keyless.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/page/app.js"' in page.text and '<canvas id="chart"' in page.text
    for path, kind in (("/page/app.js", "text/javascript"), ("/page/style.css", "text/css")):
      reply = keyless.get(path)
      assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind), path
    for path in ("/page/index.html", "/page/../app.py", "/pasta/methods", "/v1/models"):  # the rest needs the key
      error_of(keyless.get(path), 401, "authentication_error")
    error_of(keyless.post("/", content=b"{}", headers={"Content-Type": "application/json"}), 401,
             "authentication_error")


def test_the_methods_endpoint_lists_the_served_methods_and_the_limits(served):
  url, engine, _ = served
  with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http:
    info = http.get("/pasta/methods").json()
  assert [m["name"] for m in info["methods"]] == list(registry.names(serve=True))
  assert info["default"] == "pasta" and info["max_tokens"] == engine.cfg.max_tokens
  pasta = next(m for m in info["methods"] if m["name"] == "pasta")
  assert pasta["streams"] and pasta["samples"] and "fork" in pasta["summary"]


def test_pasta_threads_is_a_streaming_requests_strict_opt_in(served):
  url, engine, port = served
  with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http:
    assert error_of(post(http, {"prompt": "hi", "pasta_threads": True}), 400)["param"] == "pasta_threads"
    assert error_of(post(http, {"prompt": "hi", "stream": True, "pasta_threads": "yes"}), 400)["param"] == \
        "pasta_threads"
    threads = (ThreadText(0, None, "Hi ", (0, 1, 4), True), ThreadText(1, 0, "there", (2, 3), True))
    engine.reply = [Update("Hi", threads=threads[:1]), Update(" there", True, "stop", threads=threads)]
    try:
      asked = sse_payloads(post(http, {"prompt": "hi", "stream": True, "pasta_threads": True}).text)
      plain = sse_payloads(post(http, {"prompt": "hi", "stream": True}).text)
    finally:
      engine.reply = [Update("ok", True, "stop")]
  assert all("pasta_threads" not in chunk for chunk in plain)
  events = [e for chunk in asked for e in chunk.get("pasta_threads", [])]
  assert events == [{"thread": 0, "parent": None, "text": "Hi ", "steps": [0, 1, 4], "done": True},
                    {"thread": 1, "parent": 0, "text": "there", "steps": [2, 3], "done": True}]
  assert "".join(c["choices"][0]["text"] for c in asked if c["choices"]) == "Hi there"


def test_the_pages_own_origin_may_call_the_api_and_others_still_may_not(served):
  url, _, port = served
  with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http:
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
      assert post(http, {"prompt": "hi"}, Origin=origin, Host=origin.split("//")[1]).status_code == 200, origin
    for origin, host in ((f"http://evil.example:{port}", f"127.0.0.1:{port}"),
                         (f"http://127.0.0.1:{port + 1}", f"127.0.0.1:{port}"),
                         (f"http://evil.example:{port}", f"evil.example:{port}")):  # rebinding: the Host is refused
      error_of(post(http, {"prompt": "hi"}, Origin=origin, Host=host), 403, "permission_error")


def sse_payloads(text: str) -> list[dict]:
  lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
  return [json.loads(line) for line in lines if line != "[DONE]"]


# --- the page in Chromium ---------------------------------------------------------------------------------------
VOCAB = CharTokenizer().tag_vocab()


def tag_writing_logits(vocab_size: int) -> np.ndarray:
  """[V, V] logit biases by the input token, under which the tiny model writes the shape of a PASTA answer (its own
  logits, scaled down, still choose among what each allows): text of `a`, `b` and spaces, promises with a topic of
  `T`s and a LENGTH (so forks), a fork's `</async>`, `<sync/>` and an end (as tests/test_streamed_text.py bends it)."""
  text = [TEXT_BASE + ord(c) for c in "ab "]
  topic = TEXT_BASE + ord("T")
  bias = np.full((vocab_size, vocab_size), -50.0, np.float32)
  bias[:, text] = 1.0
  bias[:, [VOCAB.promise, VOCAB.sync, VOCAB.async_close, VOCAB.eos_ids[0]]] = [0.3, -1.0, 0.0, -2.5]
  bias[VOCAB.promise] = -50.0
  bias[VOCAB.promise, topic] = 3.0
  bias[topic] = -50.0
  bias[topic, [topic, VOCAB.lengths[0], VOCAB.lengths[1]]] = [0.0, 1.0, 0.5]
  return bias


@pytest.fixture(scope="module")
def forking_server():
  """(url, model): the real server over the tiny model with its logits bent to write PASTA answers; the bend holds
  for the module (the reference `generate` reads it too)."""
  if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(f"needs Debian's Chromium and its driver ({CHROMIUM}, {CHROMEDRIVER}): "
                "apt-get install chromium chromium-driver")
  pytest.importorskip("selenium", reason="needs selenium (the dev extras)")
  from tests.test_serve import running_server

  model = tiny_model()
  bias, original = jnp.asarray(tag_writing_logits(model.config.vocab_size)), api.model_fn

  bent = biased_model_fn(original, bias)

  # (fewer programs to compile: no lane buckets, and every chunk of the same two steps)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(api, "model_fn", bent)
    patch.setattr(api, "prepare", functools.partial(api.prepare, lane_buckets=False))
    cfg = ServeConfig(batch=1, pool_slots=256, chunk_steps=2, first_chunk_steps=2, chunk_seconds=0, max_tokens=64)
    engine = Engine(model, cfg).start()
    with running_server(engine, grace_s=0) as (url, _):
      yield url, model


@pytest.fixture(scope="module")
def browser():
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service

  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  with tempfile.TemporaryDirectory(prefix="pasta-chromium-") as profile:
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
      options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
      yield driver
    finally:
      driver.quit()


def test_the_page_streams_each_thread_into_its_column_and_composes_generates_answer(forking_server, browser):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import Select, WebDriverWait

  url, model = forking_server
  browser.get(f"{url}/")
  wait = WebDriverWait(browser, 30)
  wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#method option"))
  assert Select(browser.find_element(By.ID, "method")).first_selected_option.text == "pasta"  # the model's default
  for field, value in (("prompt", PROMPT), ("temperature", "1"), ("top-p", "1"), ("max-tokens", str(MAX_TOKENS)),
                       ("seed", str(SEED))):
    box = browser.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)
  # every change to a thread's column, counted, so the test sees the columns fill as the stream goes
  browser.execute_script("window.columnChanges = 0; new MutationObserver(() => window.columnChanges++).observe("
                         "document.getElementById('threads'), {subtree: true, childList: true, characterData: true})")
  browser.find_element(By.ID, "send").click()
  status = browser.find_element(By.ID, "status")
  WebDriverWait(browser, 600).until(lambda d: status.get_attribute("class") in ("done", "error"))
  assert status.get_attribute("class") == "done", status.text

  columns = {int(c.get_attribute("data-thread")): c.find_element(By.CLASS_NAME, "thread-text").get_attribute(
      "textContent") for c in browser.find_elements(By.CSS_SELECTOR, "#threads .thread")}
  filled = [thread for thread, text in columns.items() if text.strip()]
  assert len(filled) >= 2 and 0 in filled, columns
  assert browser.execute_script("return window.columnChanges") > len(columns)  # more than one fill per column
  sampling = SamplingConfig(temperature=1.0, top_p=1.0, seed=SEED)
  [want] = generate(model, [PROMPT], "pasta", max_new_tokens=MAX_TOKENS, chat=True, sampling=sampling)
  assert browser.find_element(By.ID, "answer").get_attribute("textContent") == want.text
  assert sorted(columns) == sorted({int(t) for t in want.records[:, 2]})  # a column per thread of the answer
  assert len(browser.find_element(By.ID, "chart").screenshot_as_png) > 0
