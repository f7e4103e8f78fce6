"""APAR mode of the jitted interpreter equals the reference's APAR mode (the oracle).

Same records, steps, stalls, finished/truncated, parents, peak live slots and the final pool
table (which slots each write reused after early release), over hypothesis-generated fork
programs driven by forced scripts, and over sampled runs of a toy model biased towards forks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference import AparRequest, run_reference
from pasta_jax.decode.rules import AparRules
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from tests.programs import PLAIN_TOKENS, VOCAB, VOCAB_SIZE, prompts, same_run_up_to_a_near_tie

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
FORCED_PARAMS = toy_params(TOY, {})
SAMPLING_PARAMS = toy_params(TOY, {VOCAB.apar_fork: 2.5, 1: 1.5}, seed=2)
FORK, EOS = VOCAB.apar_fork, 1


def apar(max_depth: int = 3, initial_threads: int = 1, sample_after_script: bool = False, **kw) -> InterpreterConfig:
  rules = AparRules(max_depth=max_depth, initial_threads=initial_threads, sample_after_script=sample_after_script)
  return InterpreterConfig(vocab=VOCAB, rules=rules, **{"lanes": 4, "max_threads": 16, "pool_slots": 256,
                                                        "max_steps": 200, **kw})


CONFIGS = {
    "roomy": apar(),
    "few_lanes": apar(lanes=2),
    "few_threads": apar(max_threads=3),
    "tight_pool": apar(lanes=3, pool_slots=40),
}


@st.composite
def thread_script(draw, max_pieces: int = 5) -> list[int]:
  """A thread's tokens: text pieces with forks between them (sometimes back to back), then EOS."""
  out: list[int] = []
  for _ in range(draw(st.integers(0, max_pieces))):
    out += draw(st.lists(PLAIN_TOKENS, min_size=0, max_size=6))
    out += [FORK] * draw(st.sampled_from([1, 1, 1, 2]))
  out += draw(st.lists(PLAIN_TOKENS, max_size=4))
  return out + [EOS] if draw(st.booleans()) or not out else out  # an unfinished script ends in EOS anyway


@st.composite
def apar_scripts(draw) -> list[list[int]]:
  return [draw(thread_script(), label=f"thread{u}") for u in range(draw(st.integers(1, 8)))]


def reference(cfg: InterpreterConfig, params, prompt_batch, scripts=None):
  return run_reference(toy_apply, params, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                       pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling,
                       script=scripts, request=AparRequest, max_depth=cfg.rules.max_depth)


def assert_same(jitted, oracle):
  assert len(jitted) == len(oracle)
  for got, want in zip(jitted, oracle):
    if not same_run_up_to_a_near_tie(got, want):
      continue
    assert (got.peak_live_slots, got.refusals) == (want.peak_live, want.refusals)
    assert {u: int(p) for u, p in enumerate(got.parents) if p >= 0} == want.parents
    table = {slot: (int(o), int(w), int(p), bool(v)) for slot, (o, w, p, v) in enumerate(got.slot_table)
             if slot in want.slot_table}
    assert table == want.slot_table


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_forced_apar_programs_match_reference(name, data):
  cfg = CONFIGS[name]
  batch = 2  # batched requests that differ; one batch shape, so fewer compiles per configuration
  scripts = [data.draw(apar_scripts(), label=f"scripts{i}") for i in range(batch)]
  prompt_batch = [data.draw(prompts, label=f"prompt{i}") for i in range(batch)]
  got = run_interpreter(toy_apply, FORCED_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                        scripts=scripts)
  assert_same(got, reference(cfg, FORCED_PARAMS, prompt_batch, scripts))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       penalty=st.sampled_from([1.0, 3.0]))
def test_sampled_apar_runs_match_reference(prompt_batch, seed, penalty):
  cfg = apar(max_steps=64, pool_slots=128, max_depth=2,
             sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=seed, repetition_penalty=penalty))
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  assert_same(got, reference(cfg, SAMPLING_PARAMS, prompt_batch))


def test_sampled_apar_runs_fork_nest_and_release():
  """Guards the tests above against vacuity: forks, nested forks and slot reuse all happen."""
  cfg = apar(max_steps=64, pool_slots=128, max_depth=2, sampling=SamplingConfig(temperature=1.0, seed=0))
  outs = run_interpreter(toy_apply, SAMPLING_PARAMS, [[5, 6, 7], [8, 9], [10, 11, 12]] * 3, cfg,
                         vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  tokens = np.concatenate([o.records[:, 3] for o in outs])
  assert (tokens == VOCAB.apar_child).sum() >= 5
  assert any((o.parents > 0).any() for o in outs)  # a child forked a grandchild
  assert any(o.slot_table[:, 1].max() >= cfg.pool_slots or (o.slot_table[:, 1] > np.arange(cfg.pool_slots)).any()
             for o in outs)  # some slot was written again after its first owner was released
  for o in outs:  # constrained: never a child token sampled, never fork right after fork/child
    sampled = [r for r in o.records.tolist() if r[3] != VOCAB.apar_child]
    assert all(r[3] not in (VOCAB.promise, VOCAB.sync, VOCAB.async_open) for r in sampled)


def test_exact_path_positions_and_views_by_hand():
  """main: a b FORK c EOS; child: x y EOS. The child and main's `c` both sit at the fork's p + 1;
  the child sees the prompt, a, b, FORK; main never sees the child; the child's slots are released."""
  cfg = apar(lanes=2)
  a, b, c, x, y = 20, 21, 22, 30, 31
  scripts = [[[a, b, FORK, c, EOS], [x, y, EOS]]]
  (got,) = run_interpreter(toy_apply, FORCED_PARAMS, [[2, 3]], cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                           scripts=scripts)
  (want,) = reference(cfg, FORCED_PARAMS, [[2, 3]], scripts)
  by_thread = {u: [(r[3], r[4]) for r in got.records.tolist() if r[2] == u] for u in (0, 1)}
  assert by_thread[0] == [(a, 2), (b, 3), (FORK, 4), (c, 5), (EOS, 6)]
  assert by_thread[1] == [(VOCAB.apar_child, 5), (x, 6), (y, 7), (EOS, 8)]
  owner = {slot: entry.thread for slot, entry in enumerate(want.pool)}
  for entry in want.pool:
    seen_owners = {owner[k] for k in entry.visible}
    assert seen_owners <= ({0, 1} if entry.thread == 1 else {0})
  assert want.annotated_tokens() == [a, b, FORK, VOCAB.apar_child, x, y, EOS, c, EOS]
  # Step 4 holds the prompt, a b FORK, CHILD, c and x at once: 8 live. Main then ends, its `c` (seen
  # by no running thread) is released, and the child's `y` reuses that slot with a later write order.
  assert got.peak_live_slots == want.peak_live == 8
  assert [tuple(int(v) for v in row) for row in got.slot_table[6:8]] == [(1, 8, 7, 0), (1, 7, 6, 0)]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fan_out_with_script_prefixes_matches_reference(data):
  """SoT's stage 2: k threads start together after a shared prompt, each forced through its own
  prefix (the point to expand), then sampling; with max_depth 0 nobody forks."""
  k = data.draw(st.integers(2, 4), label="threads")
  depth = data.draw(st.sampled_from([0, 2]), label="max_depth")
  seed = data.draw(st.integers(0, 2**16), label="seed")
  cfg = apar(lanes=4, max_steps=48, pool_slots=160, max_depth=depth, initial_threads=k, sample_after_script=True,
             sampling=SamplingConfig(temperature=1.0, seed=seed))
  batch = 2  # two requests that differ; one batch size, so only (threads, depth) add compiles
  scripts = [[data.draw(st.lists(PLAIN_TOKENS, min_size=1, max_size=5), label=f"prefix{i}.{u}") for u in range(k)]
             for i in range(batch)]
  prompt_batch = [data.draw(prompts, label=f"prompt{i}") for i in range(batch)]
  got = run_interpreter(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                        scripts=scripts)
  want = run_reference(toy_apply, SAMPLING_PARAMS, prompt_batch, cfg.vocab, lanes=cfg.lanes,
                       max_threads=cfg.max_threads, pool_slots=cfg.pool_slots, max_steps=cfg.max_steps,
                       sampling=cfg.sampling, script=scripts, request=AparRequest, max_depth=depth, initial_threads=k,
                       sample_after_script=True)
  assert_same(got, want)
  for out, script, prompt in zip(got, scripts, prompt_batch):
    for u in range(k):  # each thread replays its prefix from the prompt's end, then goes on alone
      rows = [r for r in out.records.tolist() if r[2] == u]
      assert [r[3] for r in rows[:len(script[u])]] == script[u]
      assert rows[0][4] == len(prompt)


@pytest.mark.parametrize("limit", ["depth", "lanes"])
def test_refused_forks_are_counted_like_the_reference(limit):
  """A fork that the depth limit or a full lane table forbids is counted, not dropped in silence."""
  params = toy_params(TOY, {VOCAB.apar_fork: 6.0, 1: 0.5}, seed=3)  # greedy: forks whenever it may
  cfg = apar(max_steps=48, pool_slots=128, **({"max_depth": 1} if limit == "depth" else {"lanes": 2, "max_depth": 8}))
  prompt_batch = [[3, 4, 5], [6, 7]]
  outs = run_interpreter(toy_apply, params, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  assert_same(outs, reference(cfg, params, prompt_batch))
  assert all(o.refusals > 0 for o in outs)
