"""Scoped mode constraints (the earlier paper's INVALID_TAGS): a property test over random thread states that a
tag is sampleable exactly when it keeps the answer completable to well-formed scoped text (the parser is the
oracle), the jitted masks equal the reference's, and garbage, sampled or forced, cannot crash the loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference.scoped import scoped_constraint_mask
from pasta_jax.decode.result import scoped_text_order
from pasta_jax.decode.rules.scoped import scoped_allowed
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import toy_apply, toy_params
from pasta_jax.errors import TagError
from pasta_jax.lang import scoped
from tests.programs import PLAIN_TOKENS, VOCAB, VOCAB_SIZE, prompts
from tests.test_scoped_interpreter import POOL_SPEC, TOY, reference, scoped_config

MAX_DEPTH = 3
EOS = VOCAB.eos_ids[0]
CANDIDATES = sorted(VOCAB.tag_ids | {EOS, 20})  # every tag, the end id, one text token


@st.composite
def thread_states(draw):
  """A lane's thread as a real prefix: scopes opened per level of the fork chain, the lane at level `depth`."""
  depth = draw(st.integers(0, MAX_DEPTH))
  opened = []
  for k in range(depth + 1):  # main needs a scope to promise in; all levels together stay within the limit
    least = 1 if k == 0 and depth > 0 else 0
    opened.append(draw(st.integers(least, MAX_DEPTH - sum(opened))) if MAX_DEPTH - sum(opened) >= least else 0)
  prefix = []
  for k in range(depth):
    prefix += [VOCAB.scope_open] * opened[k] + [20, VOCAB.bare_promise, VOCAB.async_open]
  prefix += [VOCAB.scope_open] * opened[depth] + [21]
  return dict(prefix=prefix, is_main=depth == 0, open_scopes=opened[depth], scope_depth=sum(opened),
              fork_depth=depth, may_fork=draw(st.booleans()))


def completable(ids: list[int]) -> bool:
  """Can `ids` (text order, main's thread first) be closed into well-formed scoped text? Each open element is
  closed in order (a pending `<promise/>` gets an empty block first); the parser decides."""
  if ids[-1] == EOS:  # main's end: the answer stops here (in a fork an end id counts as `</async>`)
    nested = ids.count(VOCAB.async_open) - ids.count(VOCAB.async_close)
    ids = ids[:-1] + ([VOCAB.async_close] if nested > 0 else [])
    if nested == 0:
      return _parses(ids)
  stack = []
  for t in ids:
    if t in (VOCAB.scope_open, VOCAB.async_open):
      stack.append(t)
    elif t in (VOCAB.scope_close, VOCAB.async_close) and stack:
      stack.pop()
  tail = [VOCAB.async_open, VOCAB.async_close] if ids[-1] == VOCAB.bare_promise else []
  tail += [VOCAB.scope_close if t == VOCAB.scope_open else VOCAB.async_close for t in reversed(stack)]
  return _parses(ids + tail)


def _parses(ids: list[int]) -> bool:
  try:
    scoped.parse_tokens(ids, VOCAB, max_depth=MAX_DEPTH)
    return True
  except TagError:
    return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=thread_states())
def test_sampleable_tags_are_exactly_the_syntactically_valid_ones(state):
  prefix, may_fork = state.pop("prefix"), state["may_fork"]
  reference_mask = scoped_constraint_mask(VOCAB, VOCAB_SIZE, max_depth=MAX_DEPTH, **state)
  jitted = np.asarray(scoped_allowed(VOCAB, VOCAB_SIZE, max_depth=MAX_DEPTH,
                                     **{k: jnp.asarray(v) for k, v in state.items()}))
  np.testing.assert_array_equal(jitted, reference_mask)
  for token in CANDIDATES:
    valid = token != VOCAB.async_open and completable(prefix + [token])
    if token == VOCAB.bare_promise:
      valid = valid and may_fork  # the lane reservation: a limit, not syntax
    assert bool(reference_mask[token]) == valid, (token, prefix)


GARBAGE = toy_params(TOY, {t: 4.0 for t in VOCAB.tag_ids | {EOS}}, seed=3)  # every tag likely, banned ones too


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_a_model_that_prefers_tags_writes_only_well_formed_scoped_text(prompt_batch, seed):
  cfg = scoped_config(lanes=4, max_threads=16, pool_slots=128, max_steps=80,
                      sampling=SamplingConfig(temperature=1.0, seed=seed))
  for out in run_interpreter(toy_apply, GARBAGE, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC):
    ids = scoped_text_order(out.records, out.parents, VOCAB)
    assert not set(ids) & (VOCAB.tag_ids - set(VOCAB.scoped_tags) - {VOCAB.async_open, VOCAB.async_close})
    if out.finished:
      scoped.parse_tokens(ids[:-1], VOCAB, max_depth=MAX_DEPTH)  # raises if malformed


garbage_scripts = st.lists(st.lists(st.one_of(PLAIN_TOKENS, st.sampled_from(sorted(VOCAB.tag_ids | {EOS}))),
                                    max_size=12), min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts=garbage_scripts, prompt=prompts)
def test_forced_garbage_runs_and_matches_the_reference(scripts, prompt):
  """Token soup, tags in any order (stray closers, later-form tags, `<async>` from the script): the loop
  neither crashes nor hangs, and the jitted run still equals the reference, thread by thread."""
  from pasta_jax.lang.scoped import ThreadScript
  cfg = scoped_config(lanes=3, max_threads=6, pool_slots=96, max_steps=60)
  leaves = [ThreadScript(tuple(s), ()) for s in scripts[1:]]
  tree = ThreadScript(tuple(scripts[0]), tuple(leaves))
  schedule = reference(cfg, None, [prompt], [tree], model=None)
  got = run_interpreter(toy_apply, GARBAGE, [prompt], cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC,
                        scripts=[schedule[0].scripts_by_thread])
  want = schedule[0]
  assert [tuple(r) for r in got[0].records.tolist()] == [tuple(int(x) for x in r) for r in want.records]
  assert (got[0].finished, got[0].truncated, got[0].steps) == (want.finished, want.truncated, want.steps)
