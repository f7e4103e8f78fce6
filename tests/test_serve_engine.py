"""The serving engine under traffic that once stopped it: requests with any sampling settings share one batch and
one program per method; a failing batch fails only its own requests; a failing loop restarts; a stalled engine
says so; a warm-up that fails stops start-up. Each row samples by its own values, exactly as `generate` does."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from pasta_jax.decode import batching
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError
from pasta_jax.methods import generate, generate_ids
from pasta_jax.serve import batches
from pasta_jax.serve.engine import Engine, Request, ServeConfig
from tests.tiny import tiny_model


def flat(model):
  """The model with its final norm scaled to 2% (Gemma's norm multiplies by 1 + scale): near-uniform logits, so a
  sampled answer depends on its seed (the tiny random model's own are so peaked that any seed writes the same)."""
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full_like(x, -0.98) if "final_norm" in jax.tree_util.keystr(path) else x, model.params)
  return model._replace(params=params)


MODEL = flat(tiny_model())
CFG = ServeConfig(batch=4, pool_slots=256, chunk_steps=4, max_queue=16, max_tokens=16, default_max_tokens=12)
PROMPTS = ["Tell me a tea.", "x", "Why blue sky?", "abc def"]


def ids_of(prompt: str) -> list[int]:
  return MODEL.tokenizer.encode(prompt, add_bos=True)


GREEDY = SamplingConfig()


def ask(engine: Engine, prompt: str, method: str = "sequential", sampling: SamplingConfig = GREEDY,
        max_tokens: int = 12) -> queue.Queue:
  updates: queue.Queue = queue.Queue()
  engine.submit(Request(ids=ids_of(prompt), method=method, max_tokens=max_tokens, sampling=sampling,
                        sink=updates.put))
  return updates


def collect(updates: queue.Queue) -> list:
  out = []
  while not out or not out[-1].done:
    out.append(updates.get(timeout=300))
  return out


def alone(prompt: str, method: str, sampling: SamplingConfig, max_tokens: int = 12) -> str:
  return generate_ids(MODEL, [ids_of(prompt)], method, max_new_tokens=max_tokens, sampling=sampling)[0].text


def tokens_alone(prompt: str, method: str, sampling: SamplingConfig, max_tokens: int = 12) -> list[int]:
  return generate_ids(MODEL, [ids_of(prompt)], method, max_new_tokens=max_tokens,
                      sampling=sampling)[0].records[:, 3].tolist()


@pytest.fixture(scope="module")
def engine():
  engine = Engine(MODEL, CFG).start()
  # every chunk and admission shape of the method the first test sends, compiled greedy (the others compile what
  # their requests need)
  engine.warm_up(["sequential"], prompt_tokens=16)
  yield engine
  engine.stop(grace_s=0)


def test_many_new_sampling_settings_at_once_share_one_batch_and_one_program(engine):
  """Eight requests that differ only in sampling, sent together while another request runs, are all answered
  (once, more than `max_batches` new settings in one admission pass stopped the engine for good); they share the
  method's one batch, whose programs the greedy warm-up compiled: not one program compiles for them."""
  compiled = batching.decode_programs()
  first = ask(engine, PROMPTS[0], max_tokens=16)
  pending = [ask(engine, PROMPTS[i % 4], sampling=SamplingConfig(temperature=0.11 + i / 100, top_k=i % 3,
                                                                  top_p=1 - i / 20, seed=i)) for i in range(8)]
  ends = [collect(p)[-1] for p in [first, *pending]]
  assert all(e.finish_reason in ("stop", "length") for e in ends), ends
  assert [k.method.name for k in engine.batches].count("sequential") == 1
  assert engine.health()["status"] == "ok" and engine.error is None
  assert batching.decode_programs() == compiled
  assert f"pasta_decode_programs {float(compiled)}" in engine.metrics.text().decode()


def test_greedy_and_seeded_rows_answer_as_generate_alone_while_sharing_a_batch(engine):
  """In one batch: two greedy rows (equal to greedy `generate`), and two sampled rows with their own temperature,
  top-p and seed, each equal to `generate` of its prompt alone with the same settings (a row's keys count its own
  steps from admission)."""
  settings = [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=7), SamplingConfig(),
              SamplingConfig(temperature=1.3, top_k=5, repetition_penalty=1.2, seed=11)]
  pending = [ask(engine, p, "pasta", s) for p, s in zip(PROMPTS, settings, strict=True)]
  answers = [collect(p) for p in pending]
  assert ["".join(u.delta for u in a) for a in answers] == [alone(p, "pasta", s) for p, s in zip(PROMPTS, settings)]
  served = [a[-1].result.records[:, 3].tolist() for a in answers]
  assert served == [tokens_alone(p, "pasta", s) for p, s in zip(PROMPTS, settings, strict=True)]
  assert served[1] != tokens_alone(PROMPTS[1], "pasta", dataclasses.replace(settings[1], seed=8))  # seeds matter


def test_a_burst_of_requests_is_admitted_in_one_prefill(engine, monkeypatch):
  """Requests that arrive a few milliseconds apart (clients that start together) are admitted together: the engine
  waits for the burst to end (`admit_quiet_s`, at most `admit_wait_s`) instead of prefilling its first request alone
  and the rest a moment later, which cost a 16-client burst on the shipped default a second prefill."""
  groups = []
  admit = batching.RowBatch.admit
  monkeypatch.setattr(batching.RowBatch, "admit", lambda self, prompts, *a, **k: groups.append(len(prompts)) or
                      admit(self, prompts, *a, **k))
  pending = []
  for prompt in PROMPTS:
    pending.append(ask(engine, prompt))
    time.sleep(0.01)
  answers = [collect(updates)[-1] for updates in pending]
  assert groups == [len(PROMPTS)]
  assert [a.result.text for a in answers] == [alone(p, "sequential", GREEDY) for p in PROMPTS]


def test_generate_takes_one_sampling_per_prompt():
  """Per-prompt settings in one run: each row equals that row of a run where every prompt has its settings."""
  a, b = SamplingConfig(temperature=0.8, seed=3), SamplingConfig(temperature=1.5, top_p=0.7, seed=9)
  mixed = generate(MODEL, PROMPTS[:2], "pasta", max_new_tokens=10, sampling=[a, b], chat=False)
  assert mixed[0].text == generate(MODEL, PROMPTS[:2], "pasta", max_new_tokens=10, sampling=a, chat=False)[0].text
  assert mixed[1].text == generate(MODEL, PROMPTS[:2], "pasta", max_new_tokens=10, sampling=b, chat=False)[1].text
  with pytest.raises(PastaError, match="one per prompt"):
    generate(MODEL, PROMPTS[:2], "pasta", max_new_tokens=4, sampling=[a])


def test_a_batch_that_fails_mid_chunk_fails_only_its_requests(monkeypatch):
  """An exception planted in one method's chunk: that batch's requests end with a 500 error, the other method's
  request is answered as `generate` answers it, /health stays ok, the failure is counted, and the next request to
  the failed method is served by a fresh batch."""
  engine = Engine(MODEL, CFG).start()
  try:
    run = batching.RowBatch.run
    planted = threading.Event()
    def failing(self, steps):
      if self.cfg.rules.name == "pasta" and not planted.is_set():
        planted.set()
        raise RuntimeError("planted device failure")
      return run(self, steps)
    monkeypatch.setattr(batching.RowBatch, "run", failing)
    doomed = [ask(engine, p, "pasta") for p in PROMPTS[:2]]
    fine = ask(engine, PROMPTS[2], "sequential")
    for updates in doomed:
      end = collect(updates)[-1]
      assert (end.finish_reason, end.status) == ("error", 500) and "planted device failure" in end.note
    assert "".join(u.delta for u in collect(fine)) == alone(PROMPTS[2], "sequential", SamplingConfig())
    health = engine.health()
    assert health["status"] == "ok" and "planted device failure" in health["last_failure"]
    assert 'pasta_engine_failures_total{method="pasta"} 1.0' in engine.metrics.text().decode()
    again = collect(ask(engine, PROMPTS[3], "pasta"))
    assert "".join(u.delta for u in again) == alone(PROMPTS[3], "pasta", SamplingConfig())
  finally:
    engine.stop(grace_s=0)


def test_a_failing_loop_fails_what_is_in_flight_and_restarts(monkeypatch):
  engine = Engine(MODEL, CFG)
  check = engine.programs.check
  calls = iter([RuntimeError("planted loop failure")])
  def failing_check():
    err = next(calls, None)
    if err is not None:
      raise err
    check()
  monkeypatch.setattr(engine.programs, "check", failing_check)
  waiting = ask(engine, PROMPTS[0])  # queued before the loop starts: the failure ends it
  engine.start()
  try:
    end = collect(waiting)[-1]
    assert (end.finish_reason, end.status) == ("error", 500)
    assert "".join(u.delta for u in collect(ask(engine, PROMPTS[1]))) == alone(PROMPTS[1], "sequential",
                                                                                SamplingConfig())
    assert "pasta_engine_restarts_total 1.0" in engine.metrics.text().decode()
    assert engine.health()["status"] == "ok"
  finally:
    engine.stop(grace_s=0)


def test_a_stalled_engine_says_so(monkeypatch):
  engine = Engine(MODEL, dataclasses.replace(CFG, stall_s=0.4)).start()
  try:
    release = threading.Event()
    run_chunk = batches.run_chunk
    def slow(*args):
      release.wait(timeout=60)
      return run_chunk(*args)
    monkeypatch.setattr(batches, "run_chunk", slow)
    updates = ask(engine, PROMPTS[0])
    deadline = time.time() + 30
    while engine.health()["status"] != "stalled":
      assert time.time() < deadline, engine.health()
      time.sleep(0.1)
    time.sleep(1.2)  # the watchdog's next look
    assert "pasta_engine_stalls_total 1.0" in engine.metrics.text().decode()
    release.set()
    assert collect(updates)[-1].finish_reason in ("stop", "length")
    assert engine.health()["status"] == "ok"
  finally:
    release.set()
    engine.stop(grace_s=0)


def test_a_long_compile_is_progress_not_a_stall(monkeypatch):
  """Opening a batch may take longer than stall_s, and so may compiling a shape its first admission or chunk runs
  (not compiled ahead: the XLA compile of a tiny model's chunk takes about 6 s on a CPU, its tracing 1.5 s): neither
  reads as a stall. A batch of 3 rows, a shape no other test compiles, so that its programs compile here."""
  engine = Engine(MODEL, dataclasses.replace(CFG, batch=3, stall_s=4.0)).start()
  try:
    open_batch, run_chunk = batches.open_batch, batches.run_chunk
    def slow_open(*args, **kwargs):
      time.sleep(5.0)  # past stall_s: allowed while compiling
      return open_batch(*args, **kwargs)
    def slow_chunk(*args):
      time.sleep(0.3)  # within stall_s: each turn makes progress
      return run_chunk(*args)
    monkeypatch.setattr(batches, "open_batch", slow_open)
    monkeypatch.setattr(batches, "run_chunk", slow_chunk)
    assert collect(ask(engine, PROMPTS[0]))[-1].finish_reason in ("stop", "length")
    assert "pasta_engine_stalls_total 0.0" in engine.metrics.text().decode()
    assert engine.health()["status"] == "ok"
  finally:
    engine.stop(grace_s=0)


def test_a_warm_up_that_fails_stops_start_up(monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("planted compile failure")
  monkeypatch.setattr(batches, "open_batch", broken)
  engine = Engine(MODEL, CFG).start()
  try:
    with pytest.raises(PastaError, match="warm-up of 'sequential' failed: .*planted compile failure"):
      engine.warm_up(["sequential"], prompt_tokens=8)
  finally:
    engine.stop(grace_s=0)
