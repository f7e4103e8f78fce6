"""A forced scoped replay numbers its threads in spawn order: `scoped.scripts_by_thread` gives the same scripts,
by thread id, as a schedule-only run of the pure-Python reference interpreter (no model), on hypothesis
script trees: nested scopes, promises inside forks, scopes in sequence, EOS inside a scope or closing a
fork, and more promises than lanes or thread ids."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.reference.scoped import run_scoped_reference
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.lang import scoped
from tests.programs import VOCAB
from tests.scoped_programs import MAX_DEPTH, scoped_programs

UNBOUNDED = 2**30  # pool slots and steps: what the scripts of a forced answer are computed under


def reference_scripts(script: scoped.ThreadScript, lanes: int, max_threads: int) -> list[list[int]]:
  return run_scoped_reference(None, None, [[0]], VOCAB, lanes=lanes, max_threads=max_threads, pool_slots=UNBOUNDED,
                              max_steps=UNBOUNDED, sampling=SamplingConfig(), scripts=[script],
                              max_depth=MAX_DEPTH)[0].scripts_by_thread


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), lanes=st.integers(1, 6), max_threads=st.integers(1, 12))
def test_spawn_order_equals_the_reference_schedule(data, lanes, max_threads):
  script = data.draw(scoped_programs(well_formed=data.draw(st.booleans())))
  assert scoped.scripts_by_thread(script, VOCAB, lanes, max_threads) == reference_scripts(script, lanes, max_threads)


P, AO, AC, SO, SC, EOS = (VOCAB.bare_promise, VOCAB.async_open, VOCAB.async_close, VOCAB.scope_open,
                          VOCAB.scope_close, VOCAB.eos_ids[0])


def test_a_fork_that_waits_for_a_lane_takes_a_later_thread_id():
  """Main's second promise spawns before the first fork's own promise gets a lane: thread ids follow the
  schedule, not the text order."""
  answer = [SO, P, AO, 10, SO, P, AO, 20, AC, SC, AC, 11, P, AO, 30, AC, SC, EOS]
  script = scoped.answer_script(answer, VOCAB)
  got = scoped.scripts_by_thread(script, VOCAB, lanes=3, max_threads=8)
  assert got == reference_scripts(script, lanes=3, max_threads=8)
  assert [tokens[0] for tokens in got[1:]] == [10, 30, 20]  # the grandchild waited for a lane


def test_a_scope_closes_in_the_step_its_last_fork_writes_its_end():
  """Four lanes: main, forks A and B, and A's first fork. B's promise waits for a lane. That fork's lane frees
  in the step it writes `</async>`, and A's `</scope>` feeds in that same step (a closing fork no longer
  blocks), so in the next step A's second promise and B's compete, and A's lower lane takes thread 4."""
  fork_a = [SO, P, AO, AC, SC, P, AO, AC, AC]
  fork_b = [P, AO, 50, AC, SO, P, AO, AC, SC, AC]
  script = scoped.answer_script([SO, P, AO, *fork_a, P, AO, *fork_b, SC, EOS], VOCAB)
  got = scoped.scripts_by_thread(script, VOCAB, lanes=4, max_threads=8)
  assert got == reference_scripts(script, lanes=4, max_threads=8)
  assert got[4] == [AC] and got[5] == [50, AC]  # A's second fork, then B's first
