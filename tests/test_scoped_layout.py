"""The scoped training layout: built statically from the text, it must give every token exactly the visible set
and position the reference interpreter gives it dynamically; and the language's parse / validate / compose."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pasta_jax.decode.reference.scoped import run_scoped_reference
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.errors import TagError
from pasta_jax.lang import scoped
from pasta_jax.lang.scoped_layout import scoped_layout
from tests.programs import VOCAB, VOCAB_SIZE, prompts
from tests.scoped_programs import scoped_programs, text_order

PARAMS = toy_params(ToyConfig(vocab_size=VOCAB_SIZE), {})


def layout_parents(thread: np.ndarray, n: int) -> dict[int, int]:
  """Layout thread -> its spawner: the owner of the token right before its `<async>`."""
  first = {}
  for i in range(n):
    first.setdefault(int(thread[i]), i)
  return {u: int(thread[i - 1]) for u, i in first.items() if u > 0}


def thread_map(decode_parents: list[int], layout_parent: dict[int, int]) -> dict[int, int]:
  """Decode thread ids -> layout thread ids: the k-th child of a thread is the k-th child of its image."""
  mapping = {0: 0}
  for d in range(1, len(decode_parents)):
    parent = mapping[decode_parents[d]]
    rank = sum(1 for e in range(1, d) if decode_parents[e] == decode_parents[d])
    mapping[d] = sorted(u for u, p in layout_parent.items() if p == parent)[rank]
  return mapping


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=scoped_programs(well_formed=True), prompt=prompts)
def test_layout_visibility_and_positions_equal_the_reference(tree, prompt):
  run = run_scoped_reference(toy_apply, PARAMS, [prompt], VOCAB, lanes=16, max_threads=64, pool_slots=512,
                             max_steps=400, sampling=SamplingConfig(), scripts=[tree])[0]
  assert run.finished
  layout = scoped_layout(prompt, text_order(tree), VOCAB)
  n = int(layout.valid.sum())
  mask = np.asarray(layout.mask())
  mapping = thread_map(run.parents, layout_parents(layout.thread, n))
  index_of, count = {}, {}
  for i in range(n):
    u = int(layout.thread[i])
    index_of[(u, count.get(u, 0))] = i
    count[u] = count.get(u, 0) + 1
  slot_index, count = [], {}
  for entry in run.pool:
    u = mapping[entry.thread]
    slot_index.append(index_of[(u, count.get(u, 0))])
    count[u] = count.get(u, 0) + 1
  for slot, entry in enumerate(run.pool):
    i = slot_index[slot]
    assert layout.tokens[i] == entry.token
    assert layout.positions[i] == entry.position, (slot, i)
    assert {slot_index[k] for k in entry.visible} == set(np.flatnonzero(mask[i])), (slot, i)


def test_layout_targets_follow_each_threads_stream():
  p, ao, ac, so, sc = VOCAB.bare_promise, VOCAB.async_open, VOCAB.async_close, VOCAB.scope_open, VOCAB.scope_close
  answer = [so, 10, p, ao, 20, 21, ac, 11, sc, 12, 1]
  layout = scoped_layout([5, 6], answer, VOCAB)
  tokens = layout.tokens.tolist()
  assert tokens == [5, 6] + answer
  targets = dict(zip(range(len(tokens)), layout.targets.tolist()))
  promise = tokens.index(p)
  assert targets[promise] == 11  # the promise predicts its spawner's next token, not `<async>`
  assert targets[tokens.index(ao)] == 20 and targets[tokens.index(21)] == ac
  assert ao not in [t for t, m in zip(layout.targets, layout.loss_mask) if m]
  assert not layout.loss_mask[0] and layout.loss_mask[1]  # the prompt's last token predicts the answer
  # Positions: <async> and main's token after the block both sit at |V(promise)|; after </scope> main counts
  # the block's four tokens.
  pos = layout.positions.tolist()
  assert pos[tokens.index(ao)] == pos[tokens.index(11)] == pos[promise] + 1
  assert pos[tokens.index(12)] == pos[tokens.index(sc)] + 1 + 4


@pytest.mark.parametrize("text, message", [
    ("a <promise/><async>b</async>", "outside every <scope>"),
    ("<scope>a <promise/> b</scope>", "no <async> block right after"),
    ("<scope>a <async>b</async></scope>", "no <promise/> before"),
    ("<scope>a <promise/><async>b</scope>", "</scope> closes the <async>"),
    ("<scope>a", "never closed"),
    ("a </scope>", "</scope> closes nothing"),
    ("<scope><scope><scope><scope>x</scope></scope></scope></scope>", "deeper than the limit of 3"),
])
def test_malformed_text_names_the_problem_and_place(text, message):
  with pytest.raises(TagError, match="line 1, col") as err:
    scoped.parse(text, max_depth=3)
  assert message in str(err.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=scoped_programs(well_formed=True))
def test_tokens_round_trip_and_compose_drops_every_tag(tree):
  ids = text_order(tree)[:-1]  # without the end id
  items = scoped.parse_tokens(ids, VOCAB)
  assert scoped.encode(items, lambda leaf: list(leaf), VOCAB) == ids
  assert scoped.answer_script(ids, VOCAB) == tree
  content = scoped.compose_ids(ids, VOCAB)
  assert content == [t for t in ids if t not in VOCAB.tag_ids]
  text = scoped.decode(ids, lambda run: "".join(chr(97 + t % 26) for t in run), VOCAB)
  assert scoped.render(scoped.parse(text)) == text


def test_compose_replaces_each_promise_with_its_block():
  text = "<scope>Two: <promise/><async>A, nested <scope><promise/><async>a1</async></scope>.</async> and B</scope>!"
  assert scoped.compose_text(text) == "Two: A, nested a1. and B!"
  assert scoped.depth(scoped.parse(text)) == (2, 2)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=scoped_programs(well_formed=True))
def test_critical_path_is_the_schedule_with_unlimited_lanes(tree):
  run = run_scoped_reference(None, None, [[3, 4]], VOCAB, lanes=64, max_threads=64, pool_slots=1024,
                             max_steps=1000, sampling=SamplingConfig(), scripts=[tree])[0]
  assert run.finished and run.stalls == 0
  ids = text_order(tree)[:-1]
  assert scoped.critical_path(scoped.parse_tokens(ids, VOCAB), VOCAB) == run.steps
