"""A method declared in one new file (tests/steady_method.py) plus its registry line runs through `generate`,
`stream`, `pasta generate`, `pasta eval` and `pasta serve`, with no other file knowing it (docs/interpreter.md,
"Adding a method")."""

from __future__ import annotations

import fastapi.testclient
import pytest

from pasta_jax import cli
from pasta_jax.commands import generate as generate_command
from pasta_jax.commands.eval_registry import build_method, parse_spec
from pasta_jax.eval.methods import DecodeSettings
from pasta_jax.methods import Sequential, generate, registry, stream
from pasta_jax.serve.app import create_app
from pasta_jax.serve.engine import Engine, ServeConfig
from tests.steady_method import Steady
from tests.tiny import tiny_model

MODEL = tiny_model()
BUDGET = 12


@pytest.fixture(autouse=True)
def steady_registered():
  """The registry line, for this test only: other tests see the registry as shipped."""
  registry.register(Steady)
  yield
  del registry.METHODS[Steady.name]


def plain(prompt: str, past_end: bool = True, chat: bool = False) -> str:
  return generate(MODEL, [prompt], Sequential(ignore_eos=past_end), max_new_tokens=BUDGET, chat=chat)[0].text


def test_generate_and_stream_run_it_by_name_and_by_value():
  [by_name] = generate(MODEL, ["Tea?"], "steady", max_new_tokens=BUDGET, chat=False)
  assert by_name.method == "steady" and by_name.content_tokens == BUDGET and by_name.text == plain("Tea?")
  *_, [last] = stream(MODEL, ["Tea?"], Steady(past_end=False), chunk_steps=3, max_new_tokens=BUDGET, chat=False)
  assert last.text == plain("Tea?", past_end=False)


def test_the_cli_offers_it_with_its_option_flag(monkeypatch, capsys):
  monkeypatch.setattr(generate_command, "load_model", lambda path: MODEL)
  assert cli.main(["generate", "Tea?", "--method", "steady", "--max-new-tokens", str(BUDGET)]) == 0
  assert capsys.readouterr().out.startswith(plain("Tea?"))
  assert cli.main(["generate", "Tea?", "--method", "steady", "--no-past-end", "--max-new-tokens", str(BUDGET)]) == 0
  assert capsys.readouterr().out.startswith(plain("Tea?", past_end=False))
  assert cli.main(["generate", "Tea?", "--method", "pasta", "--past-end"]) == 2  # its flag, refused for another
  assert "--past-end is an option of --method steady, not of pasta" in capsys.readouterr().err


def test_pasta_eval_runs_it():
  method = build_method(parse_spec("steady"), DecodeSettings(max_new_tokens=BUDGET, chat=False), lambda path: MODEL)
  out = method.run({"id": "0", "instruction": "Tea?"})
  assert out.content_tokens == BUDGET and out.text == plain("Tea?")


def test_pasta_serve_serves_it_streamed_and_whole():
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, chunk_steps=4, max_tokens=BUDGET))
  with fastapi.testclient.TestClient(create_app(engine.start(), "tiny")) as client:
    body = {"prompt": "Tea?", "max_tokens": BUDGET, "method": "steady"}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == plain("Tea?")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as events:
      lines = [line for line in events.iter_lines() if line.startswith("data: {")]
    assert len(lines) > 2  # it streams: its capabilities say so, no list of names does
    unknown = client.post("/v1/completions", json={**body, "method": "telepathy"})
    assert unknown.status_code == 400 and "steady" in unknown.json()["error"]["message"]
