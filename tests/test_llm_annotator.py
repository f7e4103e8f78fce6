"""The LLM annotator: validation of replies (each rejection with its reason), conversion to promise
form, our worked examples, resume, concurrency without lost or duplicated rows, endpoint failures,
and a real HTTP round trip against a loopback server."""

from __future__ import annotations

import random
import re
import threading
import time

import pytest

from pasta_jax.data import llm_annotator as A
from pasta_jax.endpoint import ChatClient, Completion, EndpointError
from pasta_jax.lang.tags import round_length
from pasta_jax.lang.text import Promise, parse, strip_tags
from pasta_jax.model.runfiles import read_rows
from tests.test_judges_http import reply, serve  # noqa: F401  (the loopback server fixture)

ANSWER = "Tips:\n- Keep a fixed bedtime every single day.\n- Avoid screens for an hour before bed.\nSleep well."
GOOD = ("Tips:\n<async topic='bedtime'>- Keep a fixed bedtime every single day.\n</async>"
        "<async topic='no screens'>- Avoid screens for an hour before bed.\n</async><sync/>Sleep well.")


def chars(text: str) -> int:
  """A stand-in tokenizer: one token per character, so lengths are easy to predict."""
  return len(text)


def check(reply_text: str, answer: str = ANSWER) -> A.Annotation:
  return A.validate(reply_text, answer, chars)


# --- validation ----------------------------------------------------------------------------------------
def test_valid_reply_becomes_promise_form():
  result = check(GOOD)
  assert result.reason == "" and strip_tags(result.annotated) == ANSWER
  promises = [s for s in parse(result.annotated) if isinstance(s, Promise)]
  blocks = ["- Keep a fixed bedtime every single day.\n", "- Avoid screens for an hour before bed.\n"]
  assert [p.tokens for p in promises] == [round_length(len(b)) for b in blocks] == [40, 40]
  assert all(p.tokens % 10 == 0 for p in promises) and [p.topic for p in promises] == ["bedtime", "no screens"]
  assert result.annotated.endswith("</async><sync/>Sleep well.")


@pytest.mark.parametrize("bad, reason", [
    (GOOD.replace("fixed", "set"), r"content altered: .* at character 15: expected 'fixed"),
    (GOOD.replace("every single day", "always"), "content altered"),
    (GOOD.replace("Sleep well.", "Sleep well!"), "content altered"),
    (GOOD.replace("<sync/>", ""), ""),  # no <sync/> is fine
    (GOOD.replace("topic='bedtime'", "topic='a very long topic'"), "topic 'a very long topic' has more than 3 words"),
    (GOOD.replace("topic='bedtime'", "topic=' '"), "empty topic"),
    ("Tips:\n<async topic='x'>- Keep a fixed</async> bedtime every single day.\n- Avoid screens for an hour "
     "before bed.\nSleep well.", "block '- Keep a fixed' has fewer than 5 words"),
    (ANSWER, "no block marked"),
])
def test_rejections_name_the_reason(bad, reason):
  result = check(bad)
  assert (result.annotated is None) == bool(reason)
  assert re.search(reason, result.reason) if reason else result.reason == "", result.reason


@pytest.mark.parametrize("bad, place", [
    (GOOD.replace("</async><sync/>", "<sync/>"), "nesting: '<sync/>' inside the block opened at line 3"),
    (GOOD.replace("</async><sync/>", ""), r"unclosed <async> block .* line 3, col 9"),
    (GOOD.replace("<async topic='bedtime'>", "<async>"), "annotator block without a topic.* line 2, col 1"),
    ("Tips:\n</async>" + ANSWER[6:], "stray </async> outside any block at line 2, col 1"),
])
def test_malformed_tags_are_rejected_naming_the_place(bad, place):
  result = check(bad)
  assert result.annotated is None and result.reason.startswith("malformed tags: ")
  assert re.search(place, result.reason), result.reason


def test_edge_whitespace_and_a_fence_are_forgiven_but_nothing_else():
  answer = "\n" + ANSWER + "\n"
  assert strip_tags(check(GOOD, answer).annotated) == answer  # the answer's own edges, put back
  assert check("```\n" + GOOD + "\n```", ANSWER).reason == ""
  assert check(GOOD.replace("Tips:\n", "Tips: \n"), ANSWER).reason.startswith("content altered")  # inner space
  assert check("Here you go:\n" + GOOD, ANSWER).reason.startswith("content altered")


def test_answers_that_cannot_be_annotated_are_not_sent():
  client = Scripted({})
  for answer, reason in [("  ", "empty answer"), ("Use <sync/> in the text.", "contains the tag text '<sync/>'"),
                         ('<promise topic="x" tokens="10"/>', "contains the tag text")]:
    result = A.annotate_record(client, {"id": 1, "instruction": "q", "output": answer}, chars)
    assert result.annotated is None and reason in result.reason
  assert client.calls == []


def test_our_worked_examples_are_valid():
  assert 3 <= len(A.EXAMPLES) <= 4
  for ex in A.EXAMPLES[:-1]:
    assert check(ex.annotated, ex.answer).reason == "", ex.instruction
  assert check(A.EXAMPLES[-1].annotated, A.EXAMPLES[-1].answer).reason == "no block marked"  # left alone
  assert all(rule in A.SYSTEM for rule in ("at least 5 words", "at most 3 words", "<sync/>", "exactly"))


# --- running over files --------------------------------------------------------------------------------
class Scripted:
  """A fake client: the reply for each answer from `script` (text, or an exception to raise), the
  answer unchanged otherwise; records every answer it was asked about."""

  def __init__(self, script, delay=0.0):
    self.script, self.delay, self.calls, self.lock = script, delay, [], threading.Lock()

  def complete(self, messages, **kw):
    answer = messages[-1]["content"].split(A.ANSWER_HEADER, 1)[1]
    with self.lock:
      self.calls.append(answer)
    time.sleep(self.delay * random.random())
    out = self.script.get(answer, answer)
    if isinstance(out, BaseException):
      raise out
    return Completion(out, None)


def records(n, good_every=2):
  return [{"id": i, "instruction": "Tips?", "output": ANSWER if i % good_every == 0 else f"Plain answer {i}."}
          for i in range(n)]


def test_resume_skips_done_ids(tmp_path):
  out = tmp_path / "progress.jsonl"
  out.write_text('{"id": "0", "annotated": null, "reason": "earlier"}\n{"id": "1", "annotated": null, "rea')
  client = Scripted({ANSWER: GOOD})
  counts = A.annotate_file(records(4), client, out, chars, progress=False)
  assert counts == {"records": 4, "accepted": 1, "rejected": 3, "resumed": 1}
  assert sorted(client.calls) == sorted(["Plain answer 1.", ANSWER, "Plain answer 3."])  # id 0 skipped
  assert sorted(r["id"] for r in read_rows(out)) == ["0", "1", "2", "3"]  # the half row replaced, no duplicate
  client.calls.clear()
  assert A.annotate_file(records(4), client, out, chars, progress=False)["resumed"] == 4 and client.calls == []


def test_concurrency_neither_loses_nor_duplicates_rows(tmp_path):
  out = tmp_path / "progress.jsonl"
  data = records(60, good_every=3) + records(5)  # repeated ids are annotated once
  client = Scripted({ANSWER: GOOD}, delay=0.01)
  counts = A.annotate_file(data, client, out, chars, concurrency=8, progress=False)
  assert counts == {"records": 60, "accepted": 20, "rejected": 40, "resumed": 0} and len(client.calls) == 60
  rows = list(read_rows(out))
  assert sorted(int(r["id"]) for r in rows) == list(range(60))
  for row in rows:
    assert (row["annotated"] is not None) == (int(row["id"]) % 3 == 0)
    assert row["reason"] == ("" if int(row["id"]) % 3 == 0 else "no block marked")


def test_a_killed_run_resumes_without_duplicates(tmp_path):
  out = tmp_path / "progress.jsonl"
  data = records(30, good_every=1000)  # distinct answers: the calls say which records were asked
  killer = Scripted({"Plain answer 21.": KeyboardInterrupt()}, delay=0.01)
  with pytest.raises(KeyboardInterrupt):
    A.annotate_file(data, killer, out, chars, concurrency=4, progress=False)
  first = {r["id"] for r in read_rows(out)}
  assert 0 < len(first) < 30
  client = Scripted({ANSWER: GOOD})
  A.annotate_file(data, client, out, chars, concurrency=4, progress=False)
  assert not {data[int(i)]["output"] for i in first} & set(client.calls)
  ids = [r["id"] for r in read_rows(out)]
  assert sorted(ids, key=int) == [str(i) for i in range(30)] and len(client.calls) == 30 - len(first)


def test_endpoint_failures_are_left_for_the_rerun(tmp_path):
  out = tmp_path / "progress.jsonl"
  gave_up = EndpointError("http://x: gave up after 7 attempts: HTTP 503")
  refused = EndpointError("http://x: HTTP 400: context too long", status=400)
  client = Scripted({"Plain answer 1.": gave_up, "Plain answer 3.": refused})
  with pytest.raises(EndpointError, match="1 of 4 answers got no reply after retries .*rerun to resume"):
    A.annotate_file(records(4), client, out, chars, progress=False)
  rows = {r["id"]: r for r in read_rows(out)}
  assert sorted(rows) == ["0", "2", "3"] and "endpoint refused this answer: " in rows["3"]["reason"]
  rerun = Scripted({})
  assert A.annotate_file(records(4), rerun, out, chars, progress=False)["records"] == 4
  assert rerun.calls == ["Plain answer 1."]


def test_a_wrong_key_or_model_stops_the_run(tmp_path):
  client = Scripted({ANSWER: EndpointError("http://x: HTTP 401: bad key", status=401)})
  with pytest.raises(EndpointError, match="HTTP 401"):
    A.annotate_file(records(1), client, tmp_path / "p.jsonl", chars, progress=False)
  assert list(read_rows(tmp_path / "p.jsonl")) == []


def test_a_dead_endpoint_stops_the_run(tmp_path):
  down = EndpointError("http://x: gave up after 7 attempts: connection failed")
  data = records(40, good_every=1000)
  client = Scripted({r["output"]: down for r in data}, delay=0.02)  # each failure takes a while, as retries do
  with pytest.raises(EndpointError, match="8 requests in a row failed after retries .*rerun to resume"):
    A.annotate_file(data, client, tmp_path / "p.jsonl", chars, concurrency=2, progress=False)
  assert len(client.calls) <= 20 and list(read_rows(tmp_path / "p.jsonl")) == []  # the queue was dropped


# --- over HTTP -----------------------------------------------------------------------------------------
def test_over_http(serve, tmp_path, monkeypatch):  # noqa: F811
  server = serve((503, "busy", {}, 0), (200, reply(GOOD), {}, 0))
  monkeypatch.setenv("PASTA_ANNOTATOR_BASE_URL", server.url)
  monkeypatch.setenv("PASTA_ANNOTATOR_MODEL", "annotator")
  monkeypatch.setenv("PASTA_ANNOTATOR_API_KEY", "sk-annotator")
  client = A.client_from_env(timeout_s=2.0)
  client = ChatClient(client.config, sleep=lambda s: None)
  counts = A.annotate_file([{"id": "r0", "instruction": "Tips?", "input": "For adults.", "output": ANSWER}],
                           client, tmp_path / "a.jsonl", chars, progress=False)
  assert counts == {"records": 1, "accepted": 1, "rejected": 0, "resumed": 0} and len(server.requests) == 2
  _, headers, body = server.requests[1]
  assert headers["Authorization"] == "Bearer sk-annotator" and body["model"] == "annotator"
  assert body["messages"][0]["content"] == A.SYSTEM and len(body["messages"]) == 2 + 2 * len(A.EXAMPLES)
  assert body["messages"][-1]["content"] == A.user_turn("Tips?\n\nFor adults.", ANSWER)
  assert body["max_tokens"] == A.reply_budget(ANSWER) and body["temperature"] == 0
  [row] = read_rows(tmp_path / "a.jsonl")
  assert row["id"] == "r0" and strip_tags(row["annotated"]) == ANSWER


def test_client_from_env_names_missing_variables(monkeypatch):
  monkeypatch.delenv("PASTA_ANNOTATOR_BASE_URL", raising=False)
  monkeypatch.setenv("PASTA_ANNOTATOR_MODEL", "m")
  with pytest.raises(EndpointError, match="set PASTA_ANNOTATOR_BASE_URL"):
    A.client_from_env()
  with pytest.raises(EndpointError, match="concurrency must be at least 1"):
    A.annotate_file([], Scripted({}), "unused.jsonl", chars, concurrency=0)
