"""Training layout: hand-checked positions/targets/horizons, invariants against independently computed
visible sets, padding/stacking, the plain baseline, and agreement with the jitted interpreter's replay."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import layout as lay
from pasta_jax.lang.schema import POSITION_MODES
from pasta_jax.lang.tags import reserved_span
from pasta_jax.visibility import HIDDEN, UNBOUNDED
from tests.lang_helpers import (
  BOS,
  EOS,
  HAND_ANSWER,
  VOCAB,
  a,
  b,
  c,
  d,
  in_vocab,
  prompts,
  replay,
  t,
  token_programs,
  vocab_for,
  w,
  x,
  y,
  z,
)

V = VOCAB
U_ = UNBOUNDED
PROMPT = [BOS, 90]
ANSWER = HAND_ANSWER  # a P t L10 [A x /A] b P L20 [A y z /A] S c P L10 [A w /A] d


def test_hand_example_pred():
  out = lay.layout_example(PROMPT, ANSWER, V)
  assert out.tokens.tolist() == PROMPT + ANSWER + [EOS]
  assert out.thread.tolist() == [0] * 6 + [1] * 3 + [0] * 3 + [2] * 4 + [0] * 4 + [3] * 3 + [0, 0]
  # L10 at position 5: <async> at 6; main's b at 5 + 1 + 12. L20 at 20: <async> at 21; <sync/> at 20 + 1 + 22.
  assert out.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 18, 19, 20, 21, 22, 23, 24,
                                    43, 44, 45, 46, 47, 48, 49, 59, 60]
  assert out.order.tolist() == list(range(25))
  assert out.valid.all()
  rows = {}
  for i in [0, 1, 2, 3, 4, 5, 9, 10, 11]:
    rows[i] = [i, HIDDEN, HIDDEN, HIDDEN]  # main before the sync: sees no fork
  for i in [6, 7, 8]:
    rows[i] = [5, i, HIDDEN, HIDDEN]  # fork 1: main up to its LENGTH (index 5)
  for i in [12, 13, 14, 15]:
    rows[i] = [11, HIDDEN, i, HIDDEN]  # fork 2: not fork 1 (not synced yet)
  for i in [16, 17, 18, 19, 23, 24]:
    rows[i] = [i, U_, U_, HIDDEN]  # from the <sync/> on, main sees forks 1 and 2
  for i in [20, 21, 22]:
    rows[i] = [19, U_, U_, i]  # fork 3 spawned after the sync: sees the synced forks
  assert out.horizon.tolist() == [rows[i] for i in range(25)]
  expected_targets = {0: 90, 1: a, 2: V.promise, 3: t, 4: V.length_token(10), 5: b, 6: x, 7: V.async_close,
                      9: V.promise, 10: V.length_token(20), 11: V.sync, 12: y, 13: z, 14: V.async_close,
                      16: c, 17: V.promise, 18: V.length_token(10), 19: d, 20: w, 21: V.async_close, 23: EOS}
  assert out.targets.tolist() == [expected_targets.get(i, lay.NO_TARGET) for i in range(25)]
  no_loss = {0, 8, 15, 22, 24}  # prompt-internal, the three </async>, the final end id
  assert out.loss_mask.tolist() == [i not in no_loss for i in range(25)]


def test_hand_example_fixed_and_oracle_positions():
  fixed = lay.layout_example(PROMPT, ANSWER, V, mode="fixed")  # R = 42 for every block
  assert fixed.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 48, 49, 50, 51, 52, 53, 54,
                                      93, 94, 95, 96, 97, 98, 99, 139, 140]
  oracle = lay.layout_example(PROMPT, ANSWER, V, mode="oracle")  # R = content + 2: no gaps at all
  assert oracle.positions.tolist() == list(range(25))
  for other in (fixed, oracle):
    for name in ("tokens", "thread", "horizon", "targets", "loss_mask"):
      assert np.array_equal(getattr(other, name), getattr(lay.layout_example(PROMPT, ANSWER, V), name))


def test_hand_mask():
  out = lay.layout_example(PROMPT, ANSWER, V)
  mask = np.asarray(out.mask())
  assert mask.shape == (25, 25)
  assert np.flatnonzero(mask[7]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # fork 1's x
  assert np.flatnonzero(mask[9]).tolist() == [0, 1, 2, 3, 4, 5, 9]  # main's b skips fork 1
  assert np.flatnonzero(mask[13]).tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13]  # fork 2: no fork 1
  assert np.flatnonzero(mask[16]).tolist() == list(range(17))  # <sync/> sees everything before it
  assert np.flatnonzero(mask[21]).tolist() == list(range(22))  # fork 3 sees synced forks 1 and 2
  assert np.flatnonzero(mask[23]).tolist() == list(range(20)) + [23]  # d: not fork 3 (never synced)


def test_answer_with_end_id_and_custom_eos():
  with_end = lay.layout_example(PROMPT, [a, 106], VOCAB.__class__.from_base(3, eos_ids=(EOS, 106)))
  assert with_end.tokens.tolist() == PROMPT + [a, 106]
  assert lay.layout_example(PROMPT, [a], V, eos_id=7).tokens.tolist() == PROMPT + [a, 7]


@pytest.mark.parametrize("content", [4, 14, 15, 33])
def test_hand_block_lengths_per_position_mode(content):
  """R for one block tagged tokens="10", worked out by hand for each of the six modes (section 6.2)."""
  from tests.lang_helpers import EXACT_VOCAB
  want = {4: dict(pred=10, fixed=40, oracle=4, tagless=4, ten=10, exact=4),
          14: dict(pred=10, fixed=40, oracle=14, tagless=14, ten=10, exact=14),
          15: dict(pred=10, fixed=40, oracle=15, tagless=15, ten=20, exact=15),  # halves round up
          33: dict(pred=10, fixed=40, oracle=33, tagless=33, ten=30, exact=33)}[content]
  names = {"pred": "pred", "fixed": "fixed", "oracle": "oracle", "oracle-tagless": "tagless",
           "oracle-10x": "ten", "pred-1x": "exact"}
  for mode, key in names.items():
    vocab = EXACT_VOCAB if mode == "pred-1x" else V
    answer = [V.promise, vocab.length_token(10), V.async_open] + [x] * content + [V.async_close, a]
    out = lay.layout_example(PROMPT, answer, vocab, mode=mode)
    after = len(PROMPT) + 3 + content + 1  # the row of `a`, main's token after the block
    assert out.positions[after] - out.positions[len(PROMPT) + 1] == reserved_span(want[key]) + 1, mode
    tag = vocab.length_token(content) if mode == "pred-1x" else vocab.no_length if mode == "oracle-tagless" \
        else answer[1]
    assert out.tokens[len(PROMPT) + 1] == tag, mode


def test_pred_1x_needs_an_exact_length_vocabulary():
  answer = [V.promise, V.length_token(10), V.async_open, x, V.async_close]
  with pytest.raises(PastaError, match="pred-1x"):
    lay.layout_example(PROMPT, answer, V, mode="pred-1x")


# --- invariants over random programs -----------------------------------------------------------------------
def explicit_length(mode: str, tagged: int, content: int) -> int:
  """The block length main reserves for, per the later paper's section 6.2, written out by hand."""
  exact = min(500, max(1, content))
  nearest_ten = min(500, max(10, 10 * math.floor(content / 10 + 0.5)))
  return {"pred": tagged, "pred-1x": exact, "fixed": 40, "oracle": content, "oracle-10x": nearest_ten,
          "oracle-tagless": content}[mode]


def explicit_layout(prompt, answer, mode, V=V):
  """Positions, threads, targets and visible sets computed independently, the interpreter's way:
  each thread keeps a set of visible indices; a fork copies main's at its spawn; a sync merges in
  every fork's tokens."""
  tokens, thread, positions, visible_sets = [], [], [], []
  main_view, fork_tokens, views = set(), [], {}
  streams = {0: []}
  cur, pos, next_main_pos = 0, 0, 0

  def emit(token, owner, position):
    i = len(tokens)
    tokens.append(token)
    thread.append(owner)
    positions.append(position)
    view = main_view if owner == 0 else views[owner]
    view.add(i)
    visible_sets.append(set(view))
    streams.setdefault(owner, []).append(i)
    if owner:
      fork_tokens.append(i)

  for token in prompt:
    emit(token, 0, next_main_pos)
    next_main_pos += 1
  for i, token in enumerate(answer):
    if V.is_length(token) and mode in ("pred-1x", "oracle-tagless"):  # the tag the mode trains
      content = answer.index(V.async_close, i) - i - 2
      token = V.lengths[0] if mode == "oracle-tagless" else V.lengths[min(500, max(1, content)) - 1]
    if token == V.async_open:
      cur = len(views) + 1
      views[cur] = set(main_view)
      content = answer.index(V.async_close, i) - i - 1
      length = explicit_length(mode, V.length_of(answer[i - 1]), content)
      pos = next_main_pos  # p + 1
      next_main_pos = pos + reserved_span(length)
    if cur:
      emit(token, cur, pos)
      pos += 1
      if token == V.async_close:
        cur = 0
      continue
    if token == V.sync:
      main_view.update(fork_tokens)
    emit(token, 0, next_main_pos)
    next_main_pos += 1
  emit(EOS, 0, next_main_pos)
  targets = {}
  for stream in streams.values():
    for p, q in zip(stream[:-1], stream[1:], strict=True):
      targets[p] = (tokens[q], q >= len(prompt))
  return tokens, thread, positions, visible_sets, targets


@given(prompts, token_programs(), st.sampled_from(POSITION_MODES))
@settings(max_examples=120, deadline=None)
def test_layout_matches_explicit_semantics(prompt, answer, mode):
  V = vocab_for(mode)
  answer = in_vocab(answer, V)
  n = len(prompt) + len(answer) + 1
  extra = 96 - n  # one padded shape: `visible` compiles once
  out = lay.layout_example(prompt, answer, V, mode=mode, length=96, num_threads=8)
  tokens, thread, positions, visible_sets, targets = explicit_layout(prompt, answer, mode, V)
  assert out.tokens[:n].tolist() == tokens
  assert out.thread[:n].tolist() == thread
  assert out.positions[:n].tolist() == positions
  assert out.valid.tolist() == [True] * n + [False] * extra
  mask = np.asarray(out.mask())
  for i in range(n + extra):
    want = visible_sets[i] if i < n else set()
    assert set(np.flatnonzero(mask[i]).tolist()) == want, i
    assert all(k <= i for k in want)  # every visible key is earlier in the layout (or itself)
  for i in range(n + extra):
    target, loss = targets.get(i, (lay.NO_TARGET, False))
    assert (int(out.targets[i]), bool(out.loss_mask[i])) == (target, loss), i
  # Nothing predicts <async>; </async> and the final end id predict nothing.
  assert not np.any(out.loss_mask & (out.targets == V.async_open))
  assert not np.any(out.loss_mask & ((out.tokens == V.async_close) | (np.arange(n + extra) == n - 1)))
  # Every answer token but <async> is predicted exactly once, and so is the end id.
  predicted = sorted(out.targets[out.loss_mask].tolist())
  assert predicted == sorted([tok for tok in tokens[len(prompt):] if tok != V.async_open])


@given(prompts, token_programs())
@settings(max_examples=60, deadline=None)
def test_positions_after_a_block(prompt, answer):
  out = lay.layout_example(prompt, answer, V)
  for i in np.flatnonzero(out.tokens == V.async_open):
    p = out.positions[i - 1]  # the promise's LENGTH token
    assert out.positions[i] == p + 1
    close = i + list(out.tokens[i:]).index(V.async_close)
    assert out.positions[i: close + 1].tolist() == list(range(p + 1, p + 2 + close - i))
    assert out.positions[close + 1] == p + 1 + reserved_span(V.length_of(int(out.tokens[i - 1])))
    assert out.targets[i - 1] == out.tokens[close + 1]  # LENGTH predicts the first main token after


@given(prompts, st.lists(st.integers(64, 127), max_size=8))
@settings(max_examples=40, deadline=None)
def test_tag_free_answer_is_the_plain_layout(prompt, answer):
  """Both layouts of a tag-free answer equal a causal layout written out here by hand (the two share
  `_lay_out`, so comparing them with each other alone could not fail)."""
  pasta = lay.layout_example(prompt, answer, V, length=20)
  plain = lay.plain_layout(prompt, answer, EOS, length=20)
  seq = list(prompt) + list(answer) + [EOS]
  n, p = len(seq), len(prompt)
  want_targets = np.zeros(20, int)
  want_targets[: n - 1] = seq[1:]  # every row predicts the next token; the loss counts from the prompt's last
  for layout in (pasta, plain):
    assert layout.tokens[:n].tolist() == seq and not layout.valid[n:].any() and layout.valid[:n].all()
    assert layout.positions[:n].tolist() == list(range(n)) and layout.thread[:n].tolist() == [0] * n
    assert layout.targets.tolist() == want_targets.tolist()
    assert layout.loss_mask.tolist() == [p - 1 <= i < n - 1 for i in range(20)]
    assert np.array_equal(np.asarray(layout.mask())[:n, :n], np.tril(np.ones((n, n), bool)))
    assert not np.asarray(layout.mask())[:, n:].any()


def test_baseline_layout_strips_annotations():
  base = lay.baseline_layout(PROMPT, ANSWER, V)
  assert base.tokens.tolist() == PROMPT + [a, x, b, y, z, c, w, d, EOS]
  assert base.positions.tolist() == list(range(11))
  assert base.num_threads == 1
  assert base.loss_mask.tolist() == [False] + [True] * 9 + [False]


def test_stack_and_pad():
  first = lay.layout_example(PROMPT, ANSWER, V)
  second = lay.layout_example([BOS], [a, b], V)
  batch = lay.stack_layouts([first, second])
  assert batch.tokens.shape == (2, 25) and batch.horizon.shape == (2, 25, 4)
  masks = np.asarray(batch.mask())
  assert masks.shape == (2, 25, 25)
  assert np.array_equal(masks[0], np.asarray(first.mask()))
  small = np.zeros((25, 25), bool)
  small[:4, :4] = np.asarray(second.mask())
  assert np.array_equal(masks[1], small)  # padding neither sees nor is seen
  assert batch.valid[1].tolist() == [True] * 4 + [False] * 21
  assert not batch.loss_mask[1, 4:].any()
  assert batch.tokens[1, 4:].tolist() == [0] * 21
  assert np.array_equal(np.asarray(jax.jit(lay.mask)(batch)), masks)  # a Layout is a pytree
  with pytest.raises(PastaError, match="cannot pad"):
    lay.pad_layout(first, 10, 4)


def test_layout_errors():
  with pytest.raises(PastaError, match="needs 25 tokens but the layout length is 24"):
    lay.layout_example(PROMPT, ANSWER, V, length=24)
  with pytest.raises(PastaError, match="4 threads but the layout allows 3"):
    lay.layout_example(PROMPT, ANSWER, V, num_threads=3)
  with pytest.raises(PastaError, match="empty prompt"):
    lay.layout_example([], [a], V)
  with pytest.raises(TagError, match="token index 1"):
    lay.layout_example(PROMPT, [a, V.async_open], V)
  with pytest.raises(PastaError, match="position mode"):
    lay.layout_example(PROMPT, ANSWER, V, mode="nope")


# --- agreement with the jitted interpreter's forced replay -----------------------------------------------
@pytest.mark.parametrize("mode", ["pred", "pred-1x", "oracle", "oracle-10x", "oracle-tagless"])  # "fixed": a
def test_layout_matches_interpreter_replay(mode):  # constant R, as "pred" (covered above)
  """Tokens, threads and positions of the layout's answer part equal what the interpreter records
  when it replays the same answer (one record per token, spliced into the annotated order), in every
  position mode: the mode's tags (Pred-1x exact lengths, the tag-less oracle's one closing token)
  and its reserved spans agree between training and decoding."""
  prompt_batch, answers, outputs = replay(mode)
  V = vocab_for(mode)
  for prompt, answer, out in zip(prompt_batch, answers, outputs, strict=True):
    assert out.finished and out.stalls == 0
    by_thread = {}
    for row in out.records.tolist():
      by_thread.setdefault(row[2], []).append((row[3], row[2], row[4]))  # (token, thread, position)
    spliced, fork = [], 0
    for rec in by_thread[0]:
      spliced.append(rec)
      if V.is_length(rec[0]):
        fork += 1
        spliced += by_thread[fork]
    laid = lay.layout_example(prompt, answer, V, mode=mode)
    assert V.length_step == (1 if mode == "pred-1x" else 10)
    p = len(prompt)
    columns = (x[p:].tolist() for x in (laid.tokens, laid.thread, laid.positions))
    assert spliced == list(zip(*columns, strict=True))
