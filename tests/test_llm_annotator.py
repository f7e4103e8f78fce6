"""The LLM annotator: validation of replies (each rejection with its reason), conversion to promise
form, our worked examples, concurrency without lost or duplicated rows, resume, and a real HTTP round
trip against a loopback server."""

from __future__ import annotations

import threading

import pytest

from pasta_jax.data import llm_annotator as A
from pasta_jax.endpoint import ChatClient, Completion, EndpointConfig
from pasta_jax.lang.text import parse, strip_tags
from pasta_jax.runfiles import read_rows
from tests.test_judges_http import reply, serve  # noqa: F401  (the loopback server fixture)

ANSWER = "Tips:\n- Keep a fixed bedtime every single day.\n- Avoid screens for an hour before bed.\nSleep well."
GOOD = ("Tips:\n<async topic='bedtime'>- Keep a fixed bedtime every single day.\n</async>"
        "<async topic='no screens'>- Avoid screens for an hour before bed.\n</async><sync/>Sleep well.")


def words(text: str) -> int:
  return len(text.split())


def test_valid_reply_becomes_promise_form():
  result = A.validate(GOOD, ANSWER, words)
  assert result.reason == "" and strip_tags(result.annotated) == ANSWER
  tokens = [s.tokens for s in parse(result.annotated) if hasattr(s, "tokens")]
  assert tokens == [10, 10]  # 8 and 8 words, rounded to multiples of 10


@pytest.mark.parametrize("bad, reason", [
    (GOOD.replace("fixed", "set"), "content altered: .* at character 15"),
    (GOOD.replace("every single day", "always"), "content altered"),
    ("Tips:\n<async topic='bedtime'>- Keep a fixed bedtime every single day.\n" + ANSWER[49:],
     "malformed tags: .*unclosed"),
    (GOOD.replace("topic='bedtime'", "topic='a very long topic here'"), "more than 3 words"),
    ("Tips:\n<async topic='x'>- Keep a fixed</async> bedtime every single day.\n- Avoid screens for an hour before bed."
     "\nSleep well.", "fewer than 5 words"),
    (ANSWER, "no block marked"),
])
def test_rejections_name_the_reason(bad, reason):
  result = A.validate(bad, ANSWER, words)
  assert result.annotated is None
  assert __import__("re").search(reason, result.reason), result.reason


def test_our_worked_examples_are_valid():
  for _, answer, marked in A.EXAMPLES[:2]:
    assert A.validate(marked, answer, words).reason == ""
  assert A.validate(A.EXAMPLES[2][2], A.EXAMPLES[2][1], words).reason == "no block marked"  # a negative example


class FakeClient:
  """Replies GOOD for ANSWER records, the answer unchanged otherwise; counts calls per answer."""

  def __init__(self):
    self.calls, self.lock = [], threading.Lock()

  def complete(self, messages, **kw):
    answer = messages[-1]["content"].split("Answer:\n", 1)[1]
    with self.lock:
      self.calls.append(answer)
    return Completion(GOOD if answer == ANSWER else answer, None)


def records(n):
  return [{"id": f"r{i}", "instruction": "Tips?", "output": ANSWER if i % 2 == 0 else f"Plain answer {i}."}
          for i in range(n)]


def test_concurrent_file_run_and_resume(tmp_path):
  out = tmp_path / "annotated.jsonl"
  client = FakeClient()
  counts = A.annotate_file(records(6)[:4], client, out, words, concurrency=4, progress=False)
  assert counts == {"records": 4, "accepted": 2, "rejected": 2}
  again = A.annotate_file(records(6), client, out, words, concurrency=3, progress=False)  # resumes: 2 new
  assert again["records"] == 6 and len(client.calls) == 6
  rows = list(read_rows(out))
  assert sorted(r["id"] for r in rows) == [f"r{i}" for i in range(6)]
  assert all((r["annotated"] is None) == (r["reason"] == "no block marked") for r in rows)


def test_over_http(serve, tmp_path):  # noqa: F811
  server = serve((200, reply(GOOD), {}, 0))
  client = ChatClient(EndpointConfig(base_url=server.url, model="annotator", timeout_s=2.0), sleep=lambda s: None)
  counts = A.annotate_file(records(1), client, tmp_path / "a.jsonl", words, progress=False)
  assert counts["accepted"] == 1
  body = server.requests[0][2]
  assert body["messages"][0]["content"] == A.SYSTEM and len(body["messages"]) == 2 + 2 * len(A.EXAMPLES)
