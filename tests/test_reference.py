"""The reference interpreter against hand-worked programs from docs/interpreter.md.

Every expected record below was worked out by hand from the contract, not copied from a run.
Vocab: TagVocab.from_base(60, eos_ids=(1,)): PROMISE 60, ASYNC 61, ASYNC_END 62, SYNC 63,
APAR_FORK 64, APAR_CHILD 65, LENGTH[10] 66, LENGTH[20] 67, ... ; EOS 1.
Prompt [10, 11, 12]: slots 0-2, positions 0-2, so main's first token sits at position 3.
Records are (step, lane, thread, token, position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.reference import (
  constraint_mask,
  content_length,
  run_reference,
)
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.output import ModelOutput

VOCAB = TagVocab.from_base(60, eos_ids=(1,))
PROMISE, ASYNC, END, SYNC, APAR_FORK, APAR_CHILD = 60, 61, 62, 63, 64, 65
L10, L20 = 66, 67
EOS = 1
PROMPT = [10, 11, 12]
TOY = ToyConfig(vocab_size=128)
TOY_FN = jax.jit(toy_apply)
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def toy():
  return toy_params(TOY, {})


def run_forced(params, script, *, lanes=3, max_threads=4, pool_slots=64, max_steps=50, mode="pred"):
  return run_reference(TOY_FN, params, [PROMPT], VOCAB, lanes=lanes, max_threads=max_threads,
                       pool_slots=pool_slots, max_steps=max_steps, sampling=GREEDY, script=[script],
                       position_mode=mode)[0]


# One promise (tokens=10), a 2-token block, a sync, one more token, EOS.
BASIC = [[PROMISE, 20, L10, 21, SYNC, 22, EOS], [30, 31, END]]
BASIC_RECORDS = [
  (0, 0, 0, PROMISE, 3),  # step 0: main samples from the last prompt position
  (1, 0, 0, 20, 4),  # step 1: PROMISE fed (slot 3, pos 3); topic token sampled
  (2, 0, 0, L10, 5),  # step 2: 20 fed (slot 4); LENGTH sampled at pos 5
  (3, 1, 1, ASYNC, 6),  # step 3: LENGTH fed (slot 5): fork 1 spawns on lane 1, ASYNC at 5 + 1
  (3, 0, 0, 21, 18),  # ... main's next token at 5 + 1 + R, R = 10 + 2
  (3, 1, 1, 30, 7),  # ... the fork fed ASYNC (slot 6) in the same step and samples content
  (4, 0, 0, SYNC, 19),  # step 4: main feeds 21 (slot 7), samples SYNC
  (4, 1, 1, 31, 8),  # ... fork feeds 30 (slot 8)
  (5, 1, 1, END, 9),  # step 5: main waits at SYNC (fork running); fork feeds 31 (slot 9) -> closing
  (6, 0, 0, 22, 20),  # step 6: fork closing, not running: SYNC (slot 10) and </async> (slot 11) feed
  (7, 0, 0, EOS, 21),  # step 7: 22 fed (slot 12)
]  # step 8: EOS pending, no fork: main done without feeding; finished.


def test_basic_program(toy):
  r = run_forced(toy, BASIC)
  assert r.records == BASIC_RECORDS
  assert (r.steps, r.stalls, r.finished, r.truncated) == (7, 0, True, False)
  assert [e.token for e in r.pool] == PROMPT + [PROMISE, 20, L10, ASYNC, 21, 30, 31, SYNC, END, 22]
  assert [e.thread for e in r.pool] == [0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0]
  assert r.thread_tokens(1) == [ASYNC, 30, 31, END]
  assert r.annotated_tokens() == [PROMISE, 20, L10, ASYNC, 30, 31, END, 21, SYNC, 22, EOS]
  assert r.events() == [("spawn", 3, 1), ("close", 5, 1), ("sync", 6, 0)]
  # One logits row per record, None only for the inserted ASYNC.
  assert [row is None for row in r.logits] == [rec[3] == ASYNC for rec in r.records]


def test_basic_visible_sets(toy):
  vis = [set(e.visible) for e in run_forced(toy, BASIC).pool]
  main_before = {0, 1, 2, 3, 4, 5}
  assert vis[6] == main_before | {6}  # ASYNC sees main up to and including its LENGTH
  assert vis[7] == main_before | {7}  # main's 21: no fork token before the sync
  assert vis[9] == main_before | {6, 8, 9}  # a fork: its own tokens, not main's later 21 (slot 7)
  # <sync/> is released before attention: it sees the </async> written after it in the same step.
  assert vis[10] == set(range(12))
  assert vis[11] == main_before | {6, 8, 9, 11}  # </async> does not see the SYNC
  assert vis[12] == set(range(13))


@pytest.mark.parametrize("mode, after", [("fixed", 5 + 1 + 42), ("oracle", 5 + 1 + 2 + 2)])
def test_position_modes(toy, mode, after):
  r = run_forced(toy, BASIC, mode=mode)
  # Only main's tokens after the LENGTH move; oracle R = true length (2) + 2.
  assert r.thread_positions(0) == [3, 4, 5, after, after + 1, after + 2, after + 3]
  assert r.thread_positions(1) == [6, 7, 8, 9]
  assert [rec[:4] for rec in r.records] == [rec[:4] for rec in BASIC_RECORDS]


def test_stall_without_free_lane(toy):
  """lanes=2: the second promise's LENGTH waits while lane 1 is busy, also in its closing step."""
  script = [[PROMISE, 20, L10, PROMISE, 21, L10, SYNC, EOS], [30, 31, END], [40, END]]
  r = run_forced(toy, script, lanes=2)
  assert r.records == [
    (0, 0, 0, PROMISE, 3),
    (1, 0, 0, 20, 4),  # PROMISE fed, slot 3
    (2, 0, 0, L10, 5),  # 20 fed, slot 4
    (3, 1, 1, ASYNC, 6),  # LENGTH fed (slot 5): fork 1 on lane 1, ASYNC slot 6
    (3, 0, 0, PROMISE, 18),  # 5 + 1 + 12
    (3, 1, 1, 30, 7),
    (4, 0, 0, 21, 19),  # PROMISE (slot 7), 30 (slot 8)
    (4, 1, 1, 31, 8),
    (5, 0, 0, L10, 20),  # 21 (slot 9), 31 (slot 10)
    (5, 1, 1, END, 9),
    # step 6: LENGTH pending, lane 1 is closing (not free): stall; </async> fed (slot 11), lane freed
    (7, 1, 2, ASYNC, 21),  # step 7: lane 1 reusable now: LENGTH (slot 12, pos 20), fork 2 spawns
    (7, 0, 0, SYNC, 33),  # 20 + 1 + 12
    (7, 1, 2, 40, 22),  # ASYNC fed, slot 13
    (8, 1, 2, END, 23),  # step 8: SYNC waits; 40 fed (slot 14)
    (9, 0, 0, EOS, 34),  # step 9: SYNC (slot 15) and </async> (slot 16) fed
  ]  # step 10: main done
  assert (r.steps, r.stalls, r.finished, r.truncated) == (9, 1, True, False)
  # Fork 2 sees main (LENGTH at slot 12 included) and itself, nothing of its sibling fork 1.
  assert set(r.pool[13].visible) == {0, 1, 2, 3, 4, 5, 7, 9, 12, 13}
  assert r.events() == [("spawn", 3, 1), ("close", 5, 1), ("spawn", 7, 2), ("close", 8, 2), ("sync", 9, 0)]
  assert r.annotated_tokens() == [PROMISE, 20, L10, ASYNC, 30, 31, END, PROMISE, 21, L10, ASYNC, 40, END,
                                  SYNC, EOS]


def test_eos_before_sync(toy):
  """EOS in main with a fork running: main waits, then is done without feeding the EOS."""
  r = run_forced(toy, [[PROMISE, 20, L10, EOS], [30, 31, 32, END]])
  assert r.records == [
    (0, 0, 0, PROMISE, 3),
    (1, 0, 0, 20, 4),
    (2, 0, 0, L10, 5),
    (3, 1, 1, ASYNC, 6),  # LENGTH slot 5, ASYNC slot 6
    (3, 0, 0, EOS, 18),
    (3, 1, 1, 30, 7),
    (4, 1, 1, 31, 8),  # steps 4-6: main waits at EOS; the fork feeds 30, 31, 32 (slots 7-9)
    (5, 1, 1, 32, 9),
    (6, 1, 1, END, 10),
  ]  # step 7: no fork running: main done; </async> fed (slot 10); finished in that step
  assert (r.steps, r.stalls, r.finished, r.truncated) == (7, 0, True, False)
  assert EOS not in [e.token for e in r.pool]
  assert len(r.pool) == 11


def test_fork_eos_counts_as_async_end(toy):
  r = run_forced(toy, [[PROMISE, 20, L10, 21, SYNC, EOS], [30, EOS, 99]])
  assert r.records[3:] == [
    (3, 1, 1, ASYNC, 6),
    (3, 0, 0, 21, 18),
    (3, 1, 1, 30, 7),
    (4, 0, 0, SYNC, 19),  # 21 fed (slot 7)
    (4, 1, 1, END, 8),  # 30 fed (slot 8); the fork's EOS is recorded as ASYNC_END, 99 never used
    (5, 0, 0, EOS, 20),  # the fork is closing: SYNC (slot 9) and </async> (slot 10) feed together
  ]
  assert r.pool[10].token == END and r.finished and r.steps == 5


@pytest.mark.parametrize("slots, last, steps, finished, used", [
  (11, (5, 1, 1, END, 9), 5, False, 10),  # step 6 needs 2 slots (SYNC + </async>), 1 left: nothing feeds
  (12, (6, 0, 0, 22, 20), 6, False, 12),  # step 7 needs 1 slot for 22, none left
  (13, (7, 0, 0, EOS, 21), 7, True, 13),  # pool exactly full; the final EOS needs no slot
])
def test_pool_overflow(toy, slots, last, steps, finished, used):
  r = run_forced(toy, BASIC, pool_slots=slots)
  assert r.records == BASIC_RECORDS[:BASIC_RECORDS.index(last) + 1]
  assert (r.steps, r.finished, r.truncated) == (steps, finished, not finished)
  assert len(r.pool) == used


def test_thread_ids_exhausted(toy):
  """max_threads=2 (main + one fork): the second LENGTH stalls with a free lane, until the budget."""
  script = [[PROMISE, 20, L10, PROMISE, 21, L10, SYNC, EOS], [30, END]]
  r = run_forced(toy, script, lanes=3, max_threads=2, max_steps=10)
  assert r.records == [
    (0, 0, 0, PROMISE, 3),
    (1, 0, 0, 20, 4),
    (2, 0, 0, L10, 5),
    (3, 1, 1, ASYNC, 6),
    (3, 0, 0, PROMISE, 18),
    (3, 1, 1, 30, 7),
    (4, 0, 0, 21, 19),
    (4, 1, 1, END, 8),
    (5, 0, 0, L10, 20),  # the fork's </async> feeds in step 5 and lane 1 is free from step 6
  ]  # steps 6-10: no thread id left: 5 stalls, then the budget runs out
  assert (r.steps, r.stalls, r.finished, r.truncated) == (5, 5, False, True)
  assert r.annotated_tokens() == [PROMISE, 20, L10, ASYNC, 30, END, PROMISE, 21, L10]  # last LENGTH: no fork


def test_exhausted_scripts_end_threads(toy):
  """A script that runs out gives an end id (main) or ASYNC_END (fork)."""
  r = run_forced(toy, [[PROMISE, 20, L10], [30]])
  assert r.thread_tokens(0) == [PROMISE, 20, L10, EOS]
  assert r.thread_tokens(1) == [ASYNC, 30, END]
  assert r.finished


def test_main_logits_ignore_unsynced_fork(toy):
  """Main's logits before the sync do not depend on the fork's content; from the sync on they do."""
  a = run_forced(toy, BASIC)
  b = run_forced(toy, [BASIC[0], [40, 41, END]])
  main = [i for i, rec in enumerate(a.records) if rec[2] == 0]
  before = [i for i in main if a.records[i][0] < 6]  # step 6 feeds the SYNC
  after = [i for i in main if a.records[i][0] >= 6]
  assert len(before) == 5 and len(after) == 2
  for i in before:
    np.testing.assert_array_equal(a.logits[i], b.logits[i])
  for i in after:
    assert not np.allclose(a.logits[i], b.logits[i])
  # The fork's first content token comes from its ASYNC query, which sees none of its content yet.
  first = a.records.index((3, 1, 1, 30, 7))
  np.testing.assert_array_equal(a.logits[first], b.logits[first])


@pytest.mark.parametrize("record, query, seen", [
  ((6, 0, 0, 22, 20), 10, 12),  # the SYNC query (slot 10) sees slots 0-11: its row is not the last
  ((7, 0, 0, EOS, 21), 12, 13),  # 22's query (slot 12) sees slots 0-12
])
def test_logits_are_the_model_on_the_visible_tokens(toy, record, query, seen):
  """The toy model over the pool in write order, with each slot's visible set as its mask row."""
  r = run_forced(toy, BASIC)
  keys = list(range(seen))
  tokens = jnp.asarray([[r.pool[k].token for k in keys]])
  positions = jnp.asarray([[r.pool[k].position for k in keys]])
  mask = jnp.asarray([[[j in r.pool[i].visible for j in keys] for i in keys]])
  logits = TOY_FN(toy, tokens, positions, mask).logits
  np.testing.assert_allclose(r.logits[r.records.index(record)], logits[0, query], rtol=1e-5, atol=1e-5)


def test_bucket_padding_changes_nothing(toy):
  padded = run_forced(toy, BASIC)
  plain = run_reference(TOY_FN, toy, [PROMPT], VOCAB, lanes=3, max_threads=4, pool_slots=64,
                        max_steps=50, sampling=GREEDY, script=[BASIC], bucket=False)[0]
  assert plain.records == padded.records
  for x, y in zip(plain.logits, padded.logits, strict=True):
    assert (x is None) == (y is None)
    if x is not None:
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


# --- constraints and sampled runs -----------------------------------------------------------------
def test_constraint_masks():
  v = 128
  main = constraint_mask(VOCAB, v, True, False)
  inside = constraint_mask(VOCAB, v, True, True)
  fork = constraint_mask(VOCAB, v, False, False)
  for mask in (main, inside, fork):
    assert not mask[ASYNC] and not mask[APAR_CHILD] and not mask[APAR_FORK] and mask[20]
  assert not main[END] and not main[L10] and not main[L20] and main[PROMISE] and main[SYNC] and main[EOS]
  assert inside[L10] and inside[L20] and not inside[PROMISE] and not inside[SYNC] and not inside[END]
  assert not inside[EOS]
  assert not fork[PROMISE] and not fork[L10] and not fork[SYNC] and fork[END] and fork[EOS]
  assert content_length([30, 31, END, 5], VOCAB) == 2 and content_length([30, EOS], VOCAB) == 1
  assert content_length([30], VOCAB) == 1


def sampled_params():
  return toy_params(TOY, {PROMISE: 3.0, L10: 6.0, L20: 5.0, SYNC: 2.5, END: 2.5, EOS: 1.5})


def check_program(r, vocab=VOCAB):
  """Structural invariants of any run: constraints, positions, thread shapes, visibility."""
  main = r.thread_tokens(0)
  in_promise = False
  for token in main:
    assert token not in (ASYNC, APAR_CHILD, APAR_FORK)
    if in_promise:
      assert token not in (PROMISE, SYNC, END, *vocab.eos_ids)
    else:
      assert token != END and not vocab.is_length(token)
    in_promise = (in_promise or token == PROMISE) and not vocab.is_length(token)
  for u in range(1, r.num_threads):
    fork = r.thread_tokens(u)
    assert fork[0] == ASYNC and all(t not in (ASYNC, PROMISE, SYNC, APAR_CHILD, APAR_FORK) for t in fork[1:])
    assert not any(vocab.is_length(t) for t in fork) and END not in fork[:-1]
    pos = r.thread_positions(u)
    assert pos == list(range(pos[0], pos[0] + len(pos)))
  assert r.finished != r.truncated
  check_visibility(r)


def check_visibility(r):
  """Main sees a fork slot only from a SYNC written after the fork spawned; a fork sees nothing main
  wrote after its spawn, and a sibling only if a SYNC between their spawns synced it."""
  spawn_slot = {}
  for k, e in enumerate(r.pool):
    spawn_slot.setdefault(e.thread, k)
  syncs = [k for k, e in enumerate(r.pool) if e.thread == 0 and e.token == SYNC]
  for k, e in enumerate(r.pool):
    assert k in e.visible
    for j in e.visible:
      other = r.pool[j]
      if e.thread == 0 and other.thread != 0:
        assert any(spawn_slot[other.thread] < m <= k for m in syncs), (k, j)
      elif e.thread != 0 and other.thread == 0:
        assert j < spawn_slot[e.thread]
      elif e.thread != 0 and other.thread != e.thread:  # a sibling: only if synced before the spawn
        assert any(spawn_slot[other.thread] < m < spawn_slot[e.thread] for m in syncs), (k, j)


@pytest.mark.parametrize("seed", range(4))
def test_sampled_runs_obey_the_contract(seed):
  params = sampled_params()
  kw = dict(lanes=3, max_threads=5, pool_slots=96, max_steps=50, sampling=SamplingConfig(1.0, seed=seed))
  r = run_reference(TOY_FN, params, [PROMPT], VOCAB, **kw)[0]
  check_program(r)
  again = run_reference(TOY_FN, params, [PROMPT], VOCAB, **kw)[0]
  assert again.records == r.records  # keys depend on (seed, request, step, lane) only
  # Replaying the sampled tokens as a script reproduces the run and its logits.
  script = [r.thread_tokens(0)] + [r.thread_tokens(u)[1:] for u in range(1, r.num_threads)]
  if r.finished:
    replay = run_reference(TOY_FN, params, [PROMPT], VOCAB, **{**kw, "sampling": GREEDY},
                           script=[script])[0]
    assert replay.records == r.records
    for x, y in zip(replay.logits, r.logits, strict=True):
      assert (x is None and y is None) or np.array_equal(x, y)


def test_requests_are_independent():
  params = sampled_params()
  kw = dict(lanes=2, max_threads=4, pool_slots=64, max_steps=30, sampling=GREEDY)
  p2 = [5, 6, 7, 8]
  both = run_reference(TOY_FN, params, [PROMPT, p2], VOCAB, **kw)
  assert both[0].records == run_reference(TOY_FN, params, [PROMPT], VOCAB, **kw)[0].records
  assert both[1].records == run_reference(TOY_FN, params, [p2], VOCAB, **kw)[0].records


def test_bad_arguments(toy):
  with pytest.raises(ValueError, match="oracle"):
    run_reference(TOY_FN, toy, [PROMPT], VOCAB, lanes=2, max_threads=2, pool_slots=16, max_steps=4,
                  sampling=GREEDY, position_mode="oracle")
  with pytest.raises(ValueError, match="does not fit"):
    run_forced(toy, BASIC, pool_slots=2)


# --- random forced programs -----------------------------------------------------------------------
def zero_model(params, tokens, positions, mask, pool, slots, kv_positions):
  del params, positions, mask, pool, slots, kv_positions
  return ModelOutput(logits=jnp.zeros(tokens.shape + (TOY.vocab_size,)))


@st.composite
def programs(draw):
  """A main script (text, promises, syncs, EOS) and one content script per possible fork."""
  main, forks = [], []
  for _ in range(draw(st.integers(0, 6))):
    kind = draw(st.sampled_from(["text", "promise", "sync"]))
    if kind == "text":
      main.append(draw(st.integers(2, 59)))
    elif kind == "sync":
      main.append(SYNC)
    else:
      main += [PROMISE, draw(st.integers(2, 59)), draw(st.sampled_from([L10, L20]))]
      content = draw(st.lists(st.integers(2, 59), max_size=4))
      forks.append(content + [draw(st.sampled_from([END, EOS]))])
  return [main + [EOS]] + forks


@settings(max_examples=150, deadline=None)
@given(programs(), st.integers(1, 4), st.integers(1, 5), st.integers(4, 40), st.integers(0, 40),
       st.sampled_from(["pred", "fixed", "oracle"]))
def test_random_forced_programs(script, lanes, max_threads, pool_slots, max_steps, mode):
  r = run_reference(zero_model, None, [PROMPT], VOCAB, lanes=lanes, max_threads=max_threads,
                    pool_slots=pool_slots, max_steps=max_steps, sampling=GREEDY, script=[script],
                    position_mode=mode)[0]
  assert r.finished != r.truncated
  main = r.thread_tokens(0)
  assert main == script[0][:len(main)]
  for u in range(1, r.num_threads):
    fork = r.thread_tokens(u)
    content = script[u][:content_length(script[u], VOCAB)]
    assert fork[0] == ASYNC and fork[1:len(content) + 1] == content[:len(fork) - 1]
    if len(fork) == len(content) + 2:
      assert fork[-1] == END
  if r.finished:
    assert main == script[0] and all(r.thread_tokens(u)[-1] == END for u in range(1, r.num_threads))
  # Steps and lanes: records are in step order, at most one fork per lane at a time, lanes < T.
  assert [rec[0] for rec in r.records] == sorted(rec[0] for rec in r.records)
  assert all(rec[1] < lanes and rec[2] < max_threads for rec in r.records)
  assert len(r.pool) <= pool_slots and r.steps <= max_steps
  check_positions(r, script, mode)
  check_visibility(r)


def check_positions(r, script, mode):
  """Main goes +1, or +1+R after a LENGTH; fork u's ASYNC sits right after main's u-th LENGTH."""
  main, forks = [rec for rec in r.records if rec[2] == 0], 0
  for prev, cur in zip(main, main[1:], strict=False):
    step = 1
    if VOCAB.is_length(prev[3]):
      forks += 1
      fork_script = script[forks] if forks < len(script) else []
      content = {"pred": VOCAB.length_of(prev[3]), "fixed": 40,
                 "oracle": content_length(fork_script, VOCAB)}[mode]
      step += content + 2
      assert r.thread_positions(forks)[0] == prev[4] + 1
    assert cur[4] == prev[4] + step
