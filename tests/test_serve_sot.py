"""Skeleton-of-Thought served by the engine: its stages run as internal requests, and the client gets exactly
`SkeletonOfThought.run`'s answer, streamed point by point (tiny random model; its skeleton is replaced by a
fixed outline, as `run(forced_skeleton=...)` replays one, so that the expansion stage runs)."""

from __future__ import annotations

import queue

from pasta_jax.baselines.sot import SkeletonOfThought, SotConfig
from pasta_jax.lang.schema import THREAD
from pasta_jax.methods import Sot
from pasta_jax.serve import sot as served_sot
from pasta_jax.serve.engine import Engine, Request, ServeConfig
from tests.marks import HEAVY
from tests.tiny import tiny_model

MODEL = tiny_model()
CFG = ServeConfig(batch=2, pool_slots=2048, chunk_steps=4, max_tokens=24)
LANES = Sot().lanes
QUESTIONS = ["How to make tea?", "Why is the sky blue?", "Hi?"]
THREE = "1. Leaves\n2. Hot water\n3. Wait"
EIGHT = "\n".join(f"{i}. Part {i}" for i in range(1, 9))


def ask(engine: Engine, question: str, max_tokens: int) -> queue.Queue:
  updates: queue.Queue = queue.Queue()
  ids = MODEL.tokenizer.encode(MODEL.tokenizer.chat_prompt(question), add_bos=True)
  engine.submit(Request(ids=ids, method="sot", max_tokens=max_tokens, sink=updates.put, question=question))
  return updates


def collect(updates: queue.Queue) -> list:
  got = [updates.get(timeout=300)]
  while not got[-1].done:
    got.append(updates.get(timeout=300))
  return got


@HEAVY  # about a minute; test_serve.py's sot case serves both stages against generate
def test_served_sot_equals_skeleton_of_thought(monkeypatch):
  """Three questions at once in a batch of two rows: 3 points (5 spare threads) and 8 points (the whole
  fan-out) share the expansion batch; the third question gets no outline and is answered plainly."""
  outlines = {QUESTIONS[0]: THREE, QUESTIONS[1]: EIGHT}
  decoded = []
  def fixed_outline(tokenizer, question, decoded_skeleton, *args):
    decoded.append(question)
    return stage_two(tokenizer, question, outlines.get(question, decoded_skeleton), *args)
  stage_two = served_sot.stage_two
  monkeypatch.setattr(served_sot, "stage_two", fixed_outline)
  engine = Engine(MODEL, CFG).start()
  try:
    pending = [ask(engine, q, 20) for q in QUESTIONS]
    answers = [collect(p) for p in pending]
  finally:
    engine.stop(grace_s=0)
  assert sorted(decoded) == sorted(QUESTIONS)  # stage 1 ran for each question
  config = SotConfig(point_tokens=20, answer_tokens=20, lanes=LANES)
  for question, updates in zip(QUESTIONS, answers):
    want = SkeletonOfThought(MODEL, config).run(question, outlines.get(question))
    streamed = "".join(u.delta for u in updates)
    assert streamed == updates[-1].result.text == want.text
    if question in outlines:
      assert want.used_sot and len(want.points) == outlines[question].count("\n") + 1
      for update in updates[:-1]:  # point by point: each piece ends where a point ends
        assert update.delta.endswith("\n") and update.delta.count(". ") >= 1
      threads = updates[-1].result.records[:, THREAD]
      spare = [int((threads == u).sum()) for u in range(len(want.points), LANES)]
      assert spare == [2] * (LANES - len(want.points))  # spare threads end after one step, taking no room
    else:
      assert not want.used_sot and "no skeleton" in updates[-1].note
  assert 'method="sot"' in engine.metrics.text().decode()



FOUR = "1. Leaves\n2. Hot water\n3. Wait\n4. Drink"



def test_expansions_get_the_room_skeleton_of_thought_gives_them_or_a_plain_answer_with_a_note(monkeypatch):
  """The expansions end when their pool is full, so a served row must hold the pool `SkeletonOfThought` alone
  sizes (rows capped at the server's pool cut the mixed-load bench's SoT answers short): on a 512-slot server
  the expansion rows hold 1,024 slots, this expansion needs them, and the answer equals SoT's own; one that needs
  more than the rows hold is answered plainly, and the note says why."""
  small = ServeConfig(batch=1, pool_slots=512, chunk_steps=8, max_tokens=24)
  config = SotConfig(point_tokens=24, answer_tokens=24, lanes=8)
  stage_two = served_sot.stage_two
  seen = []

  def fixed_outline(tokenizer, question, decoded_skeleton, *args):
    seen.append(stage_two(tokenizer, question, FOUR, *args))
    return seen[-1]
  monkeypatch.setattr(served_sot, "stage_two", fixed_outline)
  engine = Engine(MODEL, small).start()
  try:
    last = collect(ask(engine, "Hi?", 24))[-1]
  finally:
    engine.stop(grace_s=0)
  ids, scripts, _ = seen[0]
  assert 512 < served_sot.expansion_slots(ids, scripts, config, 8) <= 1024
  assert last.result.text == SkeletonOfThought(MODEL, config).run("Hi?", FOUR).text
  assert engine._expansion_too_big(ids, scripts, config) == ""
  monkeypatch.setattr(served_sot, "EXPAND_POOL_FACTOR", 1)  # rows of one pool: this expansion no longer fits
  assert engine._expansion_too_big(ids, scripts, config) == ("the expansion needs 1024 pool slots, the server's SoT "
                                                             "rows hold 512")
