"""Sampling: greedy, top-k, top-p and temperature behave as their definitions say."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.sampling import (
  COLUMNS,
  RowSampling,
  SamplingConfig,
  draw_order,
  first_max_index,
  kept_floor,
  near_tie,
  penalize_repeats,
  sample,
  sample_rows,
  truncate,
)

LOGITS = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.07, 0.03]))
# Compiled once per shape and envelope: called op by op, their conds and loops would compile again on every example.
sample_jit = jax.jit(sample_rows, static_argnames="envelope")
truncate_jit = jax.jit(truncate)


def draws(cfg: SamplingConfig, n: int = 4000) -> np.ndarray:
  keys = jax.random.split(jax.random.key(cfg.seed), n)
  rows = jax.tree.map(jnp.asarray, RowSampling.of([cfg] * n))
  return np.asarray(sample_jit(jnp.broadcast_to(LOGITS, (n, 5)), keys, rows, cfg.envelope()))


def test_greedy_is_argmax():
  assert int(sample(LOGITS, jax.random.key(0), SamplingConfig())) == 0


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 2.5, 2.5, np.inf, np.nan]), min_size=1, max_size=40),
       rows=st.integers(1, 3))
def test_first_max_index_is_argmax_ties_infinities_and_nans_included(values, rows):
  x = np.stack([np.roll(np.asarray(values, np.float32), r) for r in range(rows)])  # [rows, V]: rows differ
  x = jnp.asarray(x) if rows > 1 else jnp.asarray(x[0])
  got = first_max_index(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_top_k_keeps_only_k_best():
  assert set(draws(SamplingConfig(temperature=1.0, top_k=2)).tolist()) == {0, 1}
  assert set(draws(SamplingConfig(temperature=1.0, top_k=1)).tolist()) == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth never is.
  assert set(draws(SamplingConfig(temperature=1.0, top_p=0.8)).tolist()) == {0, 1, 2}
  assert set(draws(SamplingConfig(temperature=1.0, top_p=0.3)).tolist()) == {0}


def test_temperature_one_matches_softmax():
  freq = np.bincount(draws(SamplingConfig(temperature=1.0, seed=3), 20000), minlength=5) / 20000
  np.testing.assert_allclose(freq, np.exp(np.asarray(LOGITS)), atol=0.015)


def test_low_temperature_sharpens():
  freq = np.bincount(draws(SamplingConfig(temperature=0.25)), minlength=5) / 4000
  assert freq[0] > 0.9


def test_same_seed_same_draws_other_seed_differs():
  a, b = draws(SamplingConfig(temperature=1.0, seed=5)), draws(SamplingConfig(temperature=1.0, seed=5))
  c = draws(SamplingConfig(temperature=1.0, seed=6))
  assert (a == b).all() and (a != c).any()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1)])
def test_bad_settings_are_refused(bad):
  with pytest.raises(ValueError, match="bad sampling settings"):
    SamplingConfig(**bad)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
  """CTRL's penalty as Hugging Face applies it (RepetitionPenaltyLogitsProcessor), on random logits of both
  signs and random seen sets."""
  torch = pytest.importorskip("torch")
  from transformers import RepetitionPenaltyLogitsProcessor

  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 50)).astype(np.float32)
  seen_ids = rng.integers(0, 50, size=(3, 12))
  seen = np.zeros((3, 50), bool)
  np.put_along_axis(seen, seen_ids, True, axis=1)
  want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(seen_ids), torch.tensor(logits)).numpy()
  got = np.asarray(penalize_repeats(jnp.asarray(logits), jnp.asarray(seen), penalty))
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_repetition_penalty_must_be_positive():
  with pytest.raises(ValueError, match="repetition_penalty"):
    SamplingConfig(repetition_penalty=0.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(0, 12), top_p=st.floats(0.05, 1.0),
       temperature=st.floats(0.2, 2.0))
def test_truncation_equals_transformers_top_k_then_top_p(seed, top_k, top_p, temperature):
  """A row's kept tokens are those Hugging Face's TopKLogitsWarper then TopPLogitsWarper keep (on distinct logits:
  ties are the one place the two may differ)."""
  torch = pytest.importorskip("torch")
  from transformers import TopKLogitsWarper, TopPLogitsWarper

  logits = np.random.default_rng(seed).permutation(np.linspace(-4, 4, 40)).astype(np.float32)[None] / temperature
  want = torch.tensor(logits)
  if top_k:
    want = TopKLogitsWarper(top_k)(None, want)
  if top_p < 1.0:
    want = TopPLogitsWarper(top_p)(None, want)
  got = truncate_jit(jnp.asarray(logits), jnp.asarray([top_k]), jnp.asarray([top_p], jnp.float32))
  np.testing.assert_array_equal(np.isfinite(want.numpy()) & (want.numpy() > -1e30),
                                np.asarray(got) > np.finfo(np.float32).min)


ROW_CONFIGS = st.builds(SamplingConfig, temperature=st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]),
                        top_k=st.sampled_from([0, 1, 3]), top_p=st.sampled_from([1.0, 0.9, 0.4]),
                        seed=st.integers(0, 2**32 - 1))


@settings(max_examples=25, deadline=None)
@given(configs=st.lists(ROW_CONFIGS, min_size=1, max_size=6), logit_seed=st.integers(0, 1000))
def test_each_row_samples_as_it_would_alone(configs, logit_seed):
  """A batch whose rows have different settings (one program, the envelope covering them all) draws for every row
  exactly what `sample` draws for that row with its own settings: greedy rows their argmax, the others by their own
  temperature, top-k and top-p."""
  logits = jnp.asarray(np.random.default_rng(logit_seed).normal(size=(len(configs), 30)).astype(np.float32) * 3)
  keys = jax.random.split(jax.random.key(logit_seed), len(configs))
  rows = jax.tree.map(jnp.asarray, RowSampling.of(configs))
  got = sample_jit(logits, keys, rows, SamplingConfig.covering(configs))
  want = [int(sample(logits[i], keys[i], cfg)) for i, cfg in enumerate(configs)]
  assert np.asarray(got).tolist() == want
  for i, cfg in enumerate(configs):
    if cfg.greedy:
      assert want[i] == int(jnp.argmax(logits[i]))


def test_an_envelope_covers_what_it_compiled_and_refuses_more():
  greedy, hot = SamplingConfig(), SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.2)
  assert SamplingConfig.covering([greedy, hot]).covers(hot) and SamplingConfig.covering([greedy, hot]).covers(greedy)
  assert not greedy.envelope().covers(hot)
  assert hot.envelope() == SamplingConfig(temperature=0.3, top_k=5, repetition_penalty=1.5).envelope()
  with pytest.raises(ValueError, match="distinct_topics"):
    SamplingConfig.covering([greedy, SamplingConfig(distinct_topics=True)])


# Sort-free truncation and the inverse-CDF sampler against their definitions.

F32 = np.finfo(np.float32)
EXTREMES = [-np.inf, float(F32.min), -1e4, -30.0, -1.0, 0.0, 0.0, 1.0, float(np.nextafter(np.float32(1), 2)), 1.0,
            2.5, 2.5, 30.0]


def reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """The tokens Hugging Face's top-k then top-p keep, by sorting, in float64: top-k keeps the logits >= the k-th
  largest; top-p walks the kept tokens from the most likely and keeps each while the mass before it is below p."""
  x = logits.astype(np.float64)
  order = np.sort(x)[::-1]
  floor = order[min(top_k, len(x)) - 1] if top_k > 0 else -np.inf
  if top_p < 1.0:
    mass = np.where(order >= floor, np.exp(order - order[0]), 0.0)
    before = np.cumsum(mass) - mass
    floor = max(floor, order[np.flatnonzero(before < top_p * mass.sum())[-1]])
  return x >= floor


def near_the_boundary(logits: np.ndarray, top_k: int, top_p: float) -> bool:
  """Whether some token's mass above lies within float32 rounding of top_p times the mass (either side is right)."""
  x = logits.astype(np.float64)
  if top_p >= 1.0:
    return False
  order = np.sort(x[reference_kept(x, top_k, 1.0)])[::-1]
  mass = np.exp(order - order[0])
  first = np.r_[True, order[1:] != order[:-1]]  # where each run of tied logits starts: its mass above is before it
  above = (np.cumsum(mass) - mass)[first]
  return bool(np.any(np.abs(above - top_p * mass.sum()) <= 1e-5 * mass.sum()))


jitted_kept_floor = jax.jit(kept_floor, static_argnames="candidates")

# No subnormal logits: a CPU flushes them to zero (and numpy, the reference, does not).
ROW_LOGITS = st.lists(st.one_of(st.sampled_from(EXTREMES), st.floats(-12, 12, width=32, allow_subnormal=False)),
                      min_size=9, max_size=9)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(ROW_LOGITS, st.integers(0, 11), st.sampled_from([1.0, 0.95, 0.9, 0.7, 0.5, 0.3, 0.1])),
                     min_size=3, max_size=3),
       candidates=st.sampled_from([1, 3, 256]))
def test_truncation_keeps_what_a_sort_keeps_ties_and_extremes_included(rows, candidates):
  """The sort-free truncation keeps exactly the tokens the sorted definition keeps, on logits with ties, near ties
  (one ulp apart), -inf, the float32 minimum and far-apart values, for top_k past the vocabulary too. `candidates`
  1 and 3 make most rows miss the lax.top_k and search (the k-th logit by counting, the nucleus by bisection);
  256 finds them in it (a nucleus only once two passes confirm it)."""
  logits = np.array([r[0] for r in rows], np.float32)
  assume(np.isfinite(logits).any(axis=1).all())  # every row has a token to keep (a constrained row always does)
  assume(not any(near_the_boundary(logits[i], k, p) for i, (_, k, p) in enumerate(rows)))
  top_k = jnp.array([r[1] for r in rows], jnp.int32)
  top_p = jnp.array([r[2] for r in rows], jnp.float32)
  floor = np.asarray(jitted_kept_floor(jnp.asarray(logits), top_k, top_p, candidates=candidates))
  for i, (_, k, p) in enumerate(rows):
    np.testing.assert_array_equal(logits[i] >= floor[i], reference_kept(logits[i], k, p), err_msg=f"row {i}")
  want = np.stack([np.where(reference_kept(logits[i], k, p), logits[i], F32.min) for i, (_, k, p) in enumerate(rows)])
  np.testing.assert_array_equal(np.asarray(truncate_jit(jnp.asarray(logits), top_k, top_p)), want)


@pytest.mark.parametrize("vocab", [300, 70000])
def test_truncation_of_a_wide_vocabulary_keeps_what_a_sort_keeps(vocab):
  """Past the lax.top_k's width: a top_k of 1000 (the counting search) and nuclei of thousands of tokens (the
  bisection), on logits with many exact ties, over several rows of the inverse CDF's table."""
  rng = np.random.default_rng(vocab)
  logits = (rng.normal(size=(5, vocab)) * 3).astype(np.float32)
  logits[:3] = np.round(logits[:3], 1)  # a tenth apart: ties everywhere
  top_k, top_p = [0, 1000, 0, 40, 1000], [0.9, 0.8, 0.15, 0.95, 1.0]
  floor = np.asarray(jitted_kept_floor(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p, jnp.float32)))
  for i in range(5):
    assert not near_the_boundary(logits[i], top_k[i], top_p[i])
    np.testing.assert_array_equal(logits[i] >= floor[i], reference_kept(logits[i], top_k[i], top_p[i]))


def sampled_counts(logits: np.ndarray, cfg: SamplingConfig, draws: int, batch: int = 4000) -> np.ndarray:
  """How often `sample_rows` draws each token of logits [V] in `draws` rows with keys of seed cfg.seed."""
  rows = jax.tree.map(jnp.asarray, RowSampling.of([cfg] * batch))
  batched = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (batch, len(logits)))
  counts = np.zeros(len(logits), np.int64)
  for start in range(0, draws, batch):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), start), batch)
    counts += np.bincount(np.asarray(sample_jit(batched, keys, rows, cfg.envelope())), minlength=len(logits))
  return counts


def truncated_softmax(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
  scaled = logits.astype(np.float64) / cfg.temperature
  kept = reference_kept(scaled, cfg.top_k, cfg.top_p)
  probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
  return probs / probs.sum()


def assert_chi_square_fits(counts: np.ndarray, probs: np.ndarray) -> None:
  """No draw outside the kept tokens, and Pearson's chi-square of the counts against probs under its 0.999
  quantile (fixed seeds: the verdict is the same on every run)."""
  chi2 = pytest.importorskip("scipy.stats").chi2
  assert counts[probs == 0].sum() == 0, f"drew tokens outside the kept set: {np.flatnonzero(counts * (probs == 0))}"
  kept = probs > 0
  expected = counts.sum() * probs[kept]
  statistic = float(np.sum((counts[kept] - expected) ** 2 / expected))
  assert statistic < chi2.ppf(0.999, max(kept.sum() - 1, 1)), (statistic, counts[kept], expected.round(1))


STEPS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -np.inf], np.float32)
FLAT = np.linspace(0.0, 0.6, 24).astype(np.float32)  # near-flat: top-p 0.2 keeps 4 tokens of 24, a fifth of the mass


@pytest.mark.parametrize(("logits", "cfg"), [
  (STEPS, SamplingConfig(temperature=1.0, seed=1)),
  (STEPS, SamplingConfig(temperature=0.6, seed=2)),
  (STEPS, SamplingConfig(temperature=1.7, top_k=3, seed=3)),
  (STEPS, SamplingConfig(temperature=1.0, top_p=0.8, seed=4)),
  (STEPS, SamplingConfig(temperature=1.3, top_k=5, top_p=0.7, seed=5)),
  (STEPS, SamplingConfig(temperature=2.0, top_p=0.3, seed=6)),  # half the rows miss a try, 1 in 180 all eight
  (FLAT, SamplingConfig(temperature=1.0, top_p=0.2, seed=7)),  # 15% miss all eight: the nucleus search draws
], ids=["t1", "t0.6", "top_k", "top_p", "top_k_top_p", "top_p_low", "flat_top_p_low"])
def test_sampled_frequencies_match_the_truncated_softmax(logits, cfg):
  """Over 20000 keys the tokens drawn fit the temperature's softmax over the kept tokens (chi-square), whether a
  row's draw came from its first try, a later one, or its nucleus's search."""
  assert_chi_square_fits(sampled_counts(logits, cfg, 20000), truncated_softmax(logits, cfg))


def test_sampled_frequencies_fit_across_the_table_of_a_wide_vocabulary():
  """A vocabulary of 5000 (ten rows of 512 columns, padded): twelve tokens in different rows and columns carry
  the mass; every other token is -inf but one far below them (e^-41 of the top's mass: a draw of it is a wrong
  pick)."""
  logits = np.full(5000, -np.inf, np.float32)
  places = [0, 7, 511, 512, 1023, 1500, 2047, 2600, 3333, 4095, 4608, 4999]
  logits[places] = np.linspace(1.0, -1.0, len(places))
  logits[2222] = -40.0
  for cfg in [SamplingConfig(temperature=1.0, seed=8), SamplingConfig(temperature=1.0, top_p=0.5, seed=9)]:
    assert_chi_square_fits(sampled_counts(logits, cfg, 12000, batch=2000), truncated_softmax(logits, cfg))


# --- near ties: where logits equal up to float rounding may choose another token --------------------------------
HOT = SamplingConfig(temperature=1.0)


def first_uniform(key: jax.Array) -> float:
  """The uniform a draw's first step reads (`_Table.draw`, attempt 0): it picks the column."""
  return float(jax.random.uniform(jax.random.fold_in(key, 0), (2,))[0])


def with_boundary_at(logits: np.ndarray, key: jax.Array, first: int) -> np.ndarray:
  """logits [V] (V <= COLUMNS: one step, tokens in order) with `first`'s logit moved so that the draw's uniform
  falls exactly on the boundary after it: the mass of tokens before and at `first` is u of the total."""
  u = first_uniform(key)
  mass = np.exp(logits.astype(np.float64) - logits.max())
  before, rest = mass[:first].sum(), mass[first + 1:].sum()
  target = (u * (before + rest) - before) / (1 - u)  # (before + m) / (before + m + rest) = u
  assume(target > 0)
  moved = logits.astype(np.float64).copy()
  moved[first] = np.log(target) + logits.max()
  return moved.astype(np.float32)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), logits=st.lists(st.floats(-3, 3), min_size=3, max_size=40))
def test_a_draw_on_a_boundary_is_a_near_tie_and_a_nudge_beyond_it_moves_it(seed, logits):
  key = jax.random.key(seed)
  first = 0 if first_uniform(key) < 0.5 else len(logits) - 2  # a boundary whose moved logit stays finite
  u = first_uniform(key)
  assume(0.05 < u < 0.95)
  on = with_boundary_at(np.array(logits, np.float32), key, first)
  assert near_tie(on, key, HOT, 1e-4)
  token = int(sample(jnp.asarray(on), key, HOT))
  through_first = np.arange(len(on)) <= first
  nudged = {int(sample(jnp.asarray(on + np.float32(d) * through_first), key, HOT)) for d in (-1e-3, 1e-3)}
  assert len(nudged) == 2 and token in nudged  # either side of the boundary draws its own token


def test_clear_choices_are_no_near_ties():
  key = jax.random.key(3)
  u = first_uniform(key)
  far = np.log(np.array([u + 0.2 if u < 0.5 else u - 0.2, 1 - (u + 0.2 if u < 0.5 else u - 0.2)], np.float32))
  assert not near_tie(far, key, HOT, 1e-4)
  assert not near_tie(np.array([2.0, 1.0, 1.9], np.float32), key, SamplingConfig(), 1e-4)
  assert near_tie(np.array([2.0, 1.0, 2.0 - 1e-5], np.float32), key, SamplingConfig(), 1e-4)  # greedy: the gap


def test_a_near_tie_of_the_second_step_of_a_draw_over_a_large_vocabulary_is_seen():
  """Past COLUMNS tokens a draw picks a column, then a row of it: tokens 3 and COLUMNS + 3 share column 3, so
  their boundary is the second step's, which the inverse CDF's order (`draw_order`) places between them."""
  key = jax.random.key(11)
  u_row = float(jax.random.uniform(jax.random.fold_in(key, 0), (2,))[1])
  logits = np.full(2 * COLUMNS, -np.inf, np.float32)
  logits[3], logits[COLUMNS + 3] = np.log(u_row), np.log(1 - u_row)  # column 3's row boundary at its uniform
  logits[4] = 0.0  # another column, so the first step has a choice too
  assert draw_order(2 * COLUMNS)[[3, COLUMNS + 3, 4]].tolist() == [6, 7, 8]
  assert near_tie(logits, key, HOT, 1e-4)
  far = u_row + 0.25 if u_row < 0.5 else u_row - 0.25
  logits[3], logits[COLUMNS + 3] = np.log(far), np.log(1 - far)
  assert not near_tie(logits, key, HOT, 1e-4)
