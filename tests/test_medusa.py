"""Medusa heads and token-tree decoding on the one decode core (model/medusa.py, decode/rules/medusa.py).

Oracles: plain greedy decoding (greedy tree decoding must equal it token for token), a full causal
forward of each node's path (a tree step's logits and heads), and a mask built by brute force from the
choices list.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api, loop
from pasta_jax.decode.latency import calibrate_latency
from pasta_jax.decode.speculation import (
  Drafter,
  accepted_needed,
  compiled_size,
  fit_latency,
  latency_table,
  paying_size,
  rules_and_inputs,
  step_times,
  tree_pays,
)
from pasta_jax.decode.tree import TokenTree, build_tree, node_probabilities
from pasta_jax.errors import PastaError, WeightsError
from pasta_jax.methods import Medusa, Pasta, Propd, Sequential, generate, generate_ids, prepare_run, stream
from pasta_jax.model import medusa
from pasta_jax.model.gemma import Gemma, causal_mask
from tests.marks import HEAVY
from tests.test_tree import choices_lists
from tests.tiny import tiny_model

MODEL = tiny_model()
UNEMBED = MODEL.params["params"]["embedder"]
# Prompts of different lengths; the tiny random model falls into loops on them, which heads that start as
# the base head (predicting the same token again) partly guess: steps accept real paths.
PROMPTS = [[2, 5, 7, 9, 11, 13], [2, 40, 41], [2] + [3] * 11 + [4]]


def random_heads(num_heads=3, seed=1, scale=0.3, shared=True, next_token=False, width=0):
  config = medusa.MedusaConfig(num_heads=num_heads, shared_head=shared, next_token=next_token, width=width)
  heads = medusa.init_heads(config, UNEMBED)
  key = jax.random.key(seed)
  return {k: v + scale * jax.random.normal(jax.random.fold_in(key, i), v.shape) if k != "out" else v
          for i, (k, v) in enumerate(heads.items())}


def drafter(num_heads=3, top_k=4, **kw):
  config = medusa.MedusaConfig(num_heads=num_heads, next_token=kw.get("next_token", False))
  return Drafter(random_heads(num_heads, **kw), config, np.full((num_heads, top_k), 0.2, np.float32))


def tokens_of(result):
  return [int(t) for t in result.records[:, 3]]


def assert_same_greedy(plain, tree_results):
  """Token for token the plain greedy answer, up to where either run was cut (pools differ in size)."""
  for p, t in zip(plain, tree_results):
    a, b = tokens_of(p), tokens_of(t)
    n = min(len(a), len(b))
    assert a[:n] == b[:n]
    assert p.finished == t.finished or not (p.finished and t.finished)
    if p.finished and t.finished:
      assert a == b


# --- heads --------------------------------------------------------------------------------------------
def test_fresh_heads_are_the_base_head_and_sizes_are_reported():
  hidden = jax.random.normal(jax.random.key(0), (5, UNEMBED.shape[1]))
  heads = medusa.init_heads(medusa.MedusaConfig(num_heads=2), UNEMBED)
  np.testing.assert_allclose(medusa.head_logits(heads, hidden, UNEMBED), np.repeat((hidden @ UNEMBED.T)[:, None], 2,
                                                                                     axis=1), rtol=1e-5, atol=1e-5)
  sizes = medusa.head_sizes(medusa.MedusaConfig(num_heads=4), 262144, 640)
  assert sizes["shared"] == 4 * (640 * 640 + 640) and sizes["own"] == sizes["shared"] + 4 * 262144 * 640


@pytest.mark.parametrize("shared", [True, False])
def test_head_top_tokens_rank_the_draft_vocabulary(shared):
  """Each head's top tokens: the brute-force ranking of its logits over the draft vocabulary, mapped to ids."""
  vocab = np.asarray([7, 300, 5, 42, 111, 260, 9, 401], np.int32)
  config = medusa.MedusaConfig(num_heads=2, shared_head=shared)
  heads = medusa.init_heads(config, UNEMBED, vocab)
  heads["w"] = 0.3 * jax.random.normal(jax.random.key(2), heads["w"].shape)
  hidden = jax.random.normal(jax.random.key(0), (3, UNEMBED.shape[1]))
  top = medusa.head_top_tokens(heads, hidden, medusa.draft_unembed(heads, UNEMBED), 3)
  for i in range(3):
    for h in range(2):
      z = np.asarray(hidden[i] + jax.nn.silu(hidden[i] @ heads["w"][h] + heads["b"][h]))
      scores = {int(t): float(z @ np.asarray(UNEMBED[t])) for t in vocab}
      assert top[i, h].tolist() == sorted(scores, key=lambda t: -scores[t])[:3]
  full = medusa.head_top_tokens(medusa.init_heads(config, UNEMBED), hidden, UNEMBED, 3)
  np.testing.assert_array_equal(full[:, 0], jax.lax.top_k(hidden @ UNEMBED.T, 3)[1])


def test_next_token_heads_read_the_token_after_h_and_start_as_plain_heads():
  """z_k = h + SiLU(W_k h + U_k e(x) + b_k), e the embedding row at unit RMS: brute force per head; U = 0 (a fresh
  head) gives plain heads' logits; heads refuse the wrong inputs."""
  hidden = jax.random.normal(jax.random.key(0), (3, UNEMBED.shape[1]))
  nxt = jnp.asarray([5, 77, 300])
  config = medusa.MedusaConfig(num_heads=2, next_token=True)
  fresh = medusa.init_heads(config, UNEMBED)
  plain = medusa.init_heads(medusa.MedusaConfig(num_heads=2), UNEMBED)
  features = medusa.next_features(UNEMBED, nxt)
  np.testing.assert_allclose(np.sqrt(np.mean(np.square(features), axis=-1)), 1.0, rtol=1e-4)
  np.testing.assert_array_equal(medusa.head_logits(fresh, hidden, UNEMBED, next_embed=features),
                                medusa.head_logits(plain, hidden, UNEMBED))
  heads = random_heads(2, next_token=True)
  got = medusa.head_states(heads, hidden, features)
  for i in range(3):
    e = np.asarray(UNEMBED[nxt[i]], np.float64)
    e = e / np.sqrt(np.mean(e * e))
    for h in range(2):
      pre = np.asarray(hidden[i]) @ np.asarray(heads["w"][h]) + e @ np.asarray(heads["u"][h]) + heads["b"][h]
      np.testing.assert_allclose(got[i, h], np.asarray(hidden[i]) + pre / (1 + np.exp(-pre)), rtol=2e-4, atol=2e-4)
  with pytest.raises(ValueError, match="next token"):
    medusa.head_states(heads, hidden)
  with pytest.raises(ValueError, match="do not read the next token"):
    medusa.head_states(plain, hidden, features)
  assert medusa.head_sizes(config, 100, 8)["shared"] == 2 * (2 * 64 + 8)


def test_wide_heads_are_two_layer_blocks_that_start_as_the_base_head():
  """z_k = h + V_k SiLU(W_k h + U_k e(x) + b_k), W_k, U_k [D, F], V_k [F, D]: brute force per head; a fresh wide
  head (V = 0) gives the base head's logits; sizes count both layers; a saved folder whose weights disagree with
  its width is refused."""
  dim, width = UNEMBED.shape[1], 24
  hidden = jax.random.normal(jax.random.key(0), (3, dim))
  nxt = jnp.asarray([5, 77, 300])
  features = medusa.next_features(UNEMBED, nxt)
  config = medusa.MedusaConfig(num_heads=2, next_token=True, width=width)
  fresh = medusa.init_heads(config, UNEMBED)
  assert fresh["w"].shape == (2, dim, width) and fresh["v"].shape == (2, width, dim)
  assert float(jnp.abs(fresh["w"]).max()) > 0  # a zero W would leave V's gradient zero
  np.testing.assert_array_equal(medusa.head_logits(fresh, hidden, UNEMBED, next_embed=features),
                                medusa.head_logits(medusa.init_heads(medusa.MedusaConfig(num_heads=2), UNEMBED), hidden,
                                                   UNEMBED))
  heads = random_heads(2, next_token=True, width=width)
  got = medusa.head_states(heads, hidden, features)
  for i in range(3):
    for h in range(2):
      pre = (np.asarray(hidden[i]) @ np.asarray(heads["w"][h]) + np.asarray(features[i]) @ np.asarray(heads["u"][h])
             + np.asarray(heads["b"][h]))
      want = np.asarray(hidden[i]) + (pre / (1 + np.exp(-pre))) @ np.asarray(heads["v"][h])
      np.testing.assert_allclose(got[i, h], want, rtol=2e-4, atol=2e-4)
  assert medusa.head_sizes(medusa.MedusaConfig(num_heads=2, width=16), 100, 8)["shared"] == 2 * (8 * 16 + 16 + 16 * 8)
  with pytest.raises(ValueError, match="width"):
    medusa.MedusaConfig(width=-1)


def test_next_token_heads_learn_what_the_next_token_tells():
  """Gradients reach U; on targets that are a function of the next token alone (which h does not carry), a few
  steps of the Medusa loss bring next_token heads' loss below plain heads'."""
  import optax
  rng = np.random.default_rng(0)
  nxt = jnp.asarray(rng.integers(0, 64, 256))
  targets = jnp.stack([(nxt * 7 + 3) % 64, (nxt * 5 + 1) % 64], axis=1)
  hidden = jnp.asarray(rng.standard_normal((256, UNEMBED.shape[1])), jnp.float32)
  losses = {}
  for next_token, width in ((False, 0), (True, 0), (True, 32)):
    config = medusa.MedusaConfig(num_heads=2, next_token=next_token, width=width)
    heads = medusa.init_heads(config, UNEMBED)
    features = medusa.next_features(UNEMBED, nxt) if next_token else None
    loss_fn = functools.partial(lambda p, c, f: medusa.medusa_loss(p, hidden, targets, UNEMBED, c, None, f)[0],
                                c=config, f=features)
    opt = optax.adam(3e-2)
    state = opt.init(heads)
    for _ in range(60):
      grads = jax.grad(loss_fn)(heads)
      if next_token:
        assert float(jnp.abs(grads["u"]).max()) > 0 or width  # a wide block's U learns once V moved
      updates, state = opt.update(grads, state)
      heads = optax.apply_updates(heads, updates)
    if width:
      assert float(jnp.abs(jax.grad(loss_fn)(heads)["u"]).max()) > 0
    losses[next_token, width] = float(loss_fn(heads))
  assert losses[True, 0] < 0.5 * losses[False, 0]
  assert losses[True, 32] < 0.5 * losses[False, 0]


@pytest.mark.parametrize("next_token, width", [(False, 0), (True, 0), (True, 12)])
def test_heads_save_and_load(tmp_path, next_token, width):
  heads = {**random_heads(next_token=next_token, width=width), "vocab": jnp.arange(40, 80, dtype=jnp.int32)}
  config = medusa.MedusaConfig(num_heads=3, next_token=next_token, width=width)
  medusa.save_heads(tmp_path, heads, config, {"note": "x"})
  loaded, config2, meta = medusa.load_heads(tmp_path)
  assert config2 == config and meta == {"note": "x"}
  for k in heads:
    np.testing.assert_array_equal(loaded[k], heads[k])
  assert loaded["vocab"].dtype == jnp.int32
  with pytest.raises(Exception, match="no Medusa heads"):
    medusa.load_heads(tmp_path / "missing")
  medusa.save_heads(tmp_path / "other", heads, dataclasses.replace(config, width=0 if width else 12))
  with pytest.raises(WeightsError, match="do not match"):
    medusa.load_heads(tmp_path / "other")


def test_medusa_loss_targets_the_tokens_two_and_more_ahead():
  positions, targets = medusa.position_targets(np.arange(10, 20), first=4, num_heads=2)
  assert positions.tolist() == list(range(3, 8))
  assert targets[:, 0].tolist() == [15, 16, 17, 18, 19] and targets[:, 1].tolist() == [16, 17, 18, 19, -1]
  hidden = jax.random.normal(jax.random.key(0), (5, UNEMBED.shape[1]))
  config = medusa.MedusaConfig(num_heads=2)
  heads = medusa.init_heads(config, UNEMBED)
  loss, per_head = medusa.medusa_loss(heads, hidden, jnp.asarray(targets), UNEMBED, config)
  log_p = jax.nn.log_softmax(hidden @ UNEMBED.T)
  expected0 = -np.mean([log_p[i, targets[i, 0]] for i in range(5)])
  expected1 = -np.mean([log_p[i, targets[i, 1]] for i in range(4)])
  np.testing.assert_allclose(per_head, [expected0, expected1], rtol=1e-5)
  np.testing.assert_allclose(loss, expected0 + 0.8 * expected1, rtol=1e-5)


# --- one tree step ------------------------------------------------------------------------------------
def tree_step(tree: TokenTree, prompt):
  """State after prefill and the first tree's layout, plus the model's outputs on the tree rows."""
  d = drafter()
  rules, inputs = rules_and_inputs(d, choices=[list(c) for c in tree.choices[1:]])
  prep = api.prepare(MODEL, [prompt], rules=rules, lanes=tree.size, max_threads=tree.size, max_new_tokens=16,
                     rule_inputs=inputs)
  state = loop.start(prep.model_fn, *api.dynamic_args(prep), cfg=loop.static_config(prep.cfg), forced=False,
                     vocab_size=prep.vocab_size, pool_spec=prep.pool_spec)
  # candidates as if a previous step had run the heads: distinct random tokens per head
  cands = jax.random.randint(jax.random.key(3), (1, rules.num_heads, rules.top_k), 200, 400)
  state = dataclasses.replace(state, rule_state=dataclasses.replace(state.rule_state, candidates=cands,
                                                                    have_candidates=jnp.ones((1,), bool)))
  state, fed = rules.before_model(state, prep.cfg, None)
  return state, fed, prep, d


@settings(max_examples=2, deadline=None)
@given(choices_lists(max_depth=3, max_rank=4, max_nodes=10))
def test_tree_mask_and_positions_equal_brute_force(choices):
  tree = TokenTree.from_choices(choices)
  prompt = [2, 9, 8, 7, 6]
  state, fed, _, _ = tree_step(tree, prompt)
  assert bool(fed.feed[0].all())
  from pasta_jax.visibility import ThreadMask
  mask = np.asarray(ThreadMask(state.horizon, state.slot_owner, state.slot_order, state.slot_valid).dense())[0]
  slot_of = np.asarray(fed.slots[0])
  for i, c in enumerate(tree.choices):
    expected = np.zeros(mask.shape[1], bool)
    expected[: len(prompt)] = True
    for j, other in enumerate(tree.choices):
      if other == c[: len(other)]:
        expected[slot_of[j]] = True
    np.testing.assert_array_equal(mask[i], expected)
    assert int(state.position[0, i]) == len(prompt) + len(c)


@settings(max_examples=2, deadline=None)
@given(choices_lists(max_depth=3, max_rank=4, max_nodes=8))
def test_tree_step_logits_equal_a_sequential_replay_of_each_path(choices):
  tree = TokenTree.from_choices(choices)
  prompt = [2, 9, 8, 7, 6, 5]
  state, fed, prep, _ = tree_step(tree, prompt)
  from pasta_jax.visibility import ThreadMask
  mask = ThreadMask(state.horizon, state.slot_owner, state.slot_order, state.slot_valid)
  out = prep.model_fn(prep.params, state.token, state.position, mask, state.pool, fed.slots, state.slot_pos,
                      return_hidden=True)
  logits, hidden = out.logits, out.head_input
  module = Gemma(MODEL.config)
  for i, c in enumerate(tree.choices):
    path = [int(state.token[0, j]) for j, other in enumerate(tree.choices) if other == c[: len(other)]]
    seq = jnp.asarray([prompt + path])
    n = seq.shape[1]
    whole = module.apply(MODEL.params, seq, jnp.arange(n)[None], causal_mask(1, n), return_hidden=True)
    full, full_hidden = whole.logits, whole.head_input
    np.testing.assert_allclose(logits[0, i], full[0, -1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hidden[0, i], full_hidden[0, -1], rtol=1e-4, atol=1e-4)  # what the heads read


# --- whole runs ---------------------------------------------------------------------------------------
@functools.cache
def plain_greedy():
  """Plain greedy decoding of PROMPTS (computed by the worker that needs it, not at collection)."""
  return generate_ids(MODEL, PROMPTS, Sequential(), max_new_tokens=48)


@settings(max_examples=2, deadline=None)
@given(choices_lists(max_depth=3, max_rank=4, max_nodes=12), st.integers(0, 3), st.booleans())
def test_greedy_tree_decoding_is_plain_greedy_decoding(choices, seed, next_token):
  d = drafter(seed=seed, next_token=next_token)
  results = generate_ids(MODEL, PROMPTS, Medusa(heads=d, choices=choices), max_new_tokens=48)
  assert_same_greedy(plain_greedy(), results)
  for r in results:
    s = r.speculation
    assert s["tree_tokens"] == sum(1 for _ in tokens_of(r)) - 1  # every token after the prefill's came from a tree


def test_tree_steps_really_accept_paths():
  """Not vacuous: on these prompts the trees accept several tokens a step, and still equal greedy."""
  d = drafter(seed=0, scale=0.05)
  results = generate_ids(MODEL, PROMPTS, Medusa(heads=d, tree_size=12), max_new_tokens=48)
  assert_same_greedy(plain_greedy(), results)
  assert max(r.speculation["accept_length"] for r in results) > 1.5


def test_typical_acceptance_bounds():
  """Typical acceptance with an unreachable threshold accepts nothing past the root: the answer is plain sampling,
  key for key; with a zero threshold it accepts the deepest path every step."""
  from pasta_jax.decode.sampling import SamplingConfig
  sampling = SamplingConfig(temperature=0.8, seed=5)
  plain = generate_ids(MODEL, PROMPTS, Sequential(), max_new_tokens=24, sampling=sampling)
  d = drafter()
  for eps, delta, check in [(1e9, 1e9, "none"), (0.0, 0.0, "all")]:
    rules, inputs = rules_and_inputs(d, tree_size=8, acceptance="typical")
    rules = dataclasses.replace(rules, typical_epsilon=eps, typical_delta=delta)
    prep = api.prepare(MODEL, PROMPTS, rules=rules, lanes=8, max_threads=8, max_new_tokens=24, sampling=sampling,
                       rule_inputs=inputs)
    runs, _ = api.run_prepared(prep)
    if check == "none":
      assert [list(r.records[:, 3]) for r in runs] == [tokens_of(p) for p in plain]
    else:
      for r in runs:
        assert r.rule_outputs["accept_length"] > 1 + 0.5 * rules.tree.max_depth


def test_propd_picks_sizes_by_its_latency_model_and_stays_lossless():
  d = drafter()
  cheap = generate_ids(MODEL, PROMPTS, Propd(heads=d, tree_size=16, latency=(1e-06, 1.0)), max_new_tokens=32)
  dear = generate_ids(MODEL, PROMPTS, Propd(heads=d, tree_size=16, latency=(1.0, 1e-06)), max_new_tokens=32)
  for runs in (cheap, dear):
    assert_same_greedy(plain_greedy(), runs)
  assert all(set(k for k, v in r.speculation["tree_sizes"].items() if v) <= {1} for r in dear)
  for r in dear:  # no tree planned: the heads ran only on probe steps, whose next plain token checks head 0 alone
    assert r.speculation["head_trials"][0] > 0 and r.speculation["head_trials"][1:] == [0, 0]
    # and every step after the first (a tree step, which finds no tree worth it) was plain decoding's own
    assert r.speculation["plain_steps"] == r.speculation["tree_steps"] - 1 > 0
  assert all(min(r.speculation["head_trials"]) > 0 for r in cheap)
  assert all(r.speculation["tree_sizes"][16] > 0 for r in cheap)
  assert fit_latency([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((2.0, 1.0))
  table, fit = step_times([1, 2, 4, 8], [1.5, 5.0, 9.0, 17.0])  # a plain step is cheaper than the trees' line
  assert fit == pytest.approx((2.0, 1.0)) and table == pytest.approx({1: 1.5, 2: 5.0, 4: 9.0, 8: 17.0})
  np.testing.assert_allclose(latency_table((2.0, 1.0), (1, 2)), [3.0, 5.0])  # (alpha, beta), even for two sizes
  np.testing.assert_allclose(latency_table({1: 0.5, 2: 0.7}, (1, 2)), [0.5, 0.7])
  with pytest.raises(PastaError, match="no step time for tree sizes"):
    latency_table({1: 0.5}, (1, 2))


def test_propd_keeps_each_lane_buckets_measured_step_time():
  """ProPD's sizes are lane buckets, each timed, so its table keeps every measurement (on a CPU T is a step function
  of the rows bucket, no line) and reports the paper's line fit beside it. With these heads, the measured table
  takes 2-node trees (1.4 tokens / 1.0 against 1.75 / 1.34) where the line, low at 4 nodes, takes 4, and compiles
  a tree of 8."""
  sizes, seconds = [1, 2, 4, 8], [1.0, 1.0, 1.34, 1.56]
  table, (alpha, beta) = step_times(sizes, seconds)
  assert table == pytest.approx(dict(zip(sizes, seconds)))
  line, fit = step_times(sizes, seconds, "line")
  assert fit == pytest.approx((alpha, beta)) == fit_latency([2, 4, 8], seconds[1:]) and line[1] == 1.0
  assert [line[s] for s in (2, 4, 8)] == pytest.approx([alpha * s + beta for s in (2, 4, 8)])
  rates = np.array([[0.4, 0.15, 0.08, 0.05], [0.5, 0.1, 0.05, 0.02], [0.45, 0.1, 0.05, 0.02]])
  tree = build_tree(rates, 8)
  assert compiled_size(tree, table, rates) == 4 and compiled_size(tree, line, rates) == 8
  with pytest.raises(PastaError, match="step-time model must be one of"):
    step_times(sizes, seconds, "curve")


def test_propd_takes_trees_up_again_when_its_heads_start_to_hit():
  """A prior of zero hit rates plans no tree at all; the probe steps still run the heads, their hits move the
  estimate, and ProPD takes trees up: still plain greedy's tokens. Without probes it would never learn."""
  good = drafter(seed=0, scale=0.05)  # heads that hit on the tiny model (see the Medusa test above)
  hopeless = dataclasses.replace(good, hit_rates=np.zeros_like(good.hit_rates))
  runs = generate_ids(MODEL, PROMPTS, Propd(heads=hopeless, tree_size=4, latency={1: 1.0, 2: 1.05, 4: 1.1}),
                      max_new_tokens=48)
  assert_same_greedy(plain_greedy(), runs)
  assert any(sum(v for k, v in r.speculation["tree_sizes"].items() if k > 1) > 0 for r in runs)
  assert max(r.speculation["accept_length"] for r in runs) > 1.2
  assert all(r.speculation["plain_steps"] > 0 for r in runs)  # it left plain decoding's steps for trees


def test_propd_picks_one_size_for_the_batch_from_its_live_requests():
  """Every row of a step computes the batch's largest tree and T(s) is the batch's step time, so ProPD picks one
  size maximising the live requests' summed expected tokens over T(s): a request whose heads always hit carries
  along one whose heads never do, and a request that is not live counts for nothing."""
  from types import SimpleNamespace
  rules, inputs = rules_and_inputs(drafter(top_k=4), tree_size=4, dynamic=True, latency={1: 1.0, 2: 1.4, 4: 1.9})
  d = rules.init_rule_state(jnp.zeros((2, 4), jnp.int32), jnp.array([4, 4]), inputs, SimpleNamespace(lanes=4))
  hits = jnp.zeros_like(d.hits).at[0, :, 0].set(1e6)  # request 0: every head's first candidate right, always
  d = dataclasses.replace(d, hits=hits, trials=jnp.full_like(d.trials, 1e6))
  pick = lambda live: [int(s) for s in rules.planned_size(d, jnp.array(live))]
  assert pick([False, True]) == [1, 1]  # request 1 alone: its trees never pay
  assert pick([True, False])[0] > 1  # request 0 alone: they do
  assert pick([True, True]) == [2, 2]  # together: (2 + 1) / 1.4 beats (1 + 1) / 1.0 and (<= 4 + 1) / 1.9


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 200), st.integers(1, 8))
def test_propd_hit_rates_learn_from_the_whole_batch(prior, observed, trials, batch):
  """Every request runs the same heads: a request's hit rate is the prior moved by the batch's steps, then by its
  own. A request with no steps of its own takes the batch's estimate; with many batch steps that is the observed
  rate, whatever the prior; a request's own many steps win over the batch's."""
  from types import SimpleNamespace
  rules, inputs = rules_and_inputs(drafter(top_k=2), tree_size=2, dynamic=True, latency={1: 1.0, 2: 1.3})
  inputs = {**inputs, "rates": jnp.full((3, 2), prior, jnp.float32)}
  d = rules.init_rule_state(jnp.zeros((batch + 1, 4), jnp.int32), jnp.full((batch + 1,), 4), inputs,
                            SimpleNamespace(lanes=2))
  seen = jnp.zeros_like(d.trials).at[:batch].set(trials)  # the last request has no steps of its own
  d = dataclasses.replace(d, trials=seen, hits=seen[:, :, None] * jnp.asarray([observed, 0.0]))
  w, n = rules.prior_weight, batch * trials
  rates = np.asarray(rules.hit_rates(d))
  pooled = (w * prior + n * observed) / (w + n)
  np.testing.assert_allclose(rates[-1, :, 0], pooled, atol=1e-5)  # the fresh request: the batch's estimate
  np.testing.assert_allclose(rates[0, :, 0], (w * pooled + trials * observed) / (w + trials), atol=1e-5)
  if n >= 100 * w:
    assert abs(rates[-1, 0, 0] - observed) < 0.01 + abs(prior - observed) * w / n
  if trials == 0:
    np.testing.assert_allclose(rates[:, :, 0], pooled, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.05, 0.95), min_size=3, max_size=3), st.floats(1.0, 30.0), st.floats(0.0, 3.0))
def test_paying_size_keeps_every_size_that_could_beat_a_plain_step(top1, slope, jump):
  """A size s can win only if T(s) < (its prefix's depth + 1) T(1); ProPD compiles up to the largest such size,
  and every larger size fails that test (so dropping it changes no choice)."""
  from pasta_jax.decode.tree import build_tree, node_probabilities
  rates = np.asarray(top1)[:, None] * np.asarray([1.0, 0.5, 0.25])[None]
  tree = build_tree(rates, 32)
  sizes = [1, 2, 4, 8, 16, 32]
  table = {s: 1.0 if s == 1 else 1.0 + jump + slope * s / 32 for s in sizes}
  size = paying_size(tree, table)
  can_pay = [s for s in sizes[1:] if table[s] < (tree.depth[:s].max() + 1) * table[1]]
  assert size == max(can_pay, default=2)
  assert all(table[s] >= (tree.depth[:s].max() + 1) for s in sizes if s > size)
  need = accepted_needed(tree, table)  # tokens a step must write to match plain: below the most it can, it may pay
  assert [s for s in need if need[s] < tree.depth[:s].max() + 1] == can_pay and list(need) == sizes[1:]
  assert accepted_needed(tree, table, 1.3) == pytest.approx({s: 1.3 * n for s, n in need.items()})
  assert accepted_needed(tree, {1: 2.0, 2: 3.0, 64: 9.0}, 1.3) == pytest.approx({2: 1.95})  # past the tree: none
  # ProPD compiles no lane it would not use on its prior, but for one bucket of room: the prior's best size
  # stays available, and nothing past twice it (or past what can pay) is compiled
  expected = np.cumsum(node_probabilities(tree, rates))
  best = max(sizes, key=lambda s: expected[s - 1] / table[s])
  compiled = compiled_size(tree, table, rates)
  assert 2 <= compiled <= size and compiled <= max(2, 2 * best) and min(best, size) <= compiled


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.0, 0.7), min_size=3, max_size=3), st.floats(1.0, 3.0), st.floats(0.0, 0.5))
def test_no_tree_pays_exactly_when_propd_would_plan_none_with_heads_that_hit_more(top1, dear, slope):
  """`tree_pays` (on the host, before compiling) against ProPD's own planner (on device): with hit rates of
  RATE_ROOM times the prior, the planner takes a tree for its first step exactly when some tree size pays."""
  from types import SimpleNamespace

  from pasta_jax.decode.speculation import RATE_ROOM
  prior = np.asarray(top1, np.float32)[:, None] * np.asarray([1.0, 0.4, 0.2, 0.1], np.float32)[None]
  table = {1: 1.0, 2: dear, 4: dear + 2 * slope, 8: dear + 6 * slope}
  rules, inputs = rules_and_inputs(drafter(top_k=4), tree_size=8, dynamic=True, latency=table)
  inputs = {**inputs, "rates": jnp.minimum(jnp.asarray(prior) * RATE_ROOM, 1.0)}
  d = rules.init_rule_state(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), inputs, SimpleNamespace(lanes=8))
  planned = int(rules.planned_size(d, jnp.array([True]))[0])
  expected = np.cumsum(node_probabilities(rules.tree, np.minimum(prior * RATE_ROOM, 1.0)))
  if abs(max(expected[s - 1] / table[s] for s in (2, 4, 8)) - 1.0) > 1e-4:  # not a tie with the plain step
    assert tree_pays(rules.tree, table, prior) == (planned > 1)


def test_propd_where_no_tree_can_pay_runs_plain_decodings_program(monkeypatch):
  """A calibration in which every tree costs more than the tokens it could bring: ProPD's tree size is 1 and it
  runs plain decoding's own program (no lanes, no heads, no tree bookkeeping): the same tokens, the same config."""
  from types import SimpleNamespace

  from pasta_jax.decode import latency
  def prepare(model, ids, *, rules, rule_inputs, max_new_tokens, **kw):
    return pinned_size(rules, rule_inputs), max_new_tokens
  def run(prep):
    size, steps = prep
    return [SimpleNamespace(steps=steps)], steps * (0.01 if size == 1 else 0.05 * size)  # T(2) = 10 T(1)
  with monkeypatch.context() as patch:
    patch.setattr(latency.api, "prepare", prepare)
    patch.setattr(latency.api, "run_prepared", run)
    info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=4, steps=8, repeats=1)
  assert info["tree_size"] == 1 and not info["tree_pays"]
  propd = prepare_run(MODEL, PROMPTS, Propd(heads=drafter(), tree_size=info["tree_size"], latency=info["table"]),
                      max_new_tokens=16)
  plain = prepare_run(MODEL, PROMPTS, Sequential(), max_new_tokens=16)
  assert propd.cfg == plain.cfg
  assert [tokens_of(r) for r in api.run_prepared(propd)[0]] == [tokens_of(r) for r in api.run_prepared(plain)[0]]


def test_propd_prepared_once_names_a_fallback_to_plain_decoding(monkeypatch, capsys):
  """ProPD's preparation (for `generate`, `pasta generate` and `pasta eval` alike) names the fallback and its step
  times, rather than printing no tree line."""
  from pasta_jax.decode import latency
  from pasta_jax.methods import Setup, prepared
  cal = {"table": {1: 0.1, 2: 0.2}, "tree_size": 1, "timed_tree": 2, "tree_pays": False}
  monkeypatch.setattr(latency, "calibrate_latency", lambda *a, **kw: cal)
  ready = prepared(Propd(heads=drafter()), MODEL, Setup([PROMPTS[0]], 16))
  assert ready.tree_size == 1 and ready.latency == cal["table"]
  assert "no tree of 2 nodes can beat a plain step here (T(1) 100.0 ms, T(2) 200.0 ms" in capsys.readouterr().err


def pinned_size(rules, rule_inputs) -> int:
  """The tree size a calibration run pins: the one whose step time is not 1e9."""
  return rules.sizes[int(np.argmin(np.asarray(rule_inputs["latency"])))]


def test_propd_from_python_measures_its_own_step_times_as_the_cli_does():
  """`generate(model, prompts, "propd")` with no step-time table: ProPD times its sizes on this batch first (once
  per model and batch shape) and decodes plain greedy's tokens."""
  runs = generate_ids(MODEL, PROMPTS[:1], Propd(heads=drafter(), tree_size=4), max_new_tokens=12)
  plain = generate_ids(MODEL, PROMPTS[:1], Sequential(), max_new_tokens=12)
  assert_same_greedy(plain, runs)  # whether the measured times chose a tree or plain steps


@HEAVY  # times every size for real; test_calibration_cancels_the_prefill holds its arithmetic and
# test_propd_from_python_measures_its_own_step_times_as_the_cli_does runs it whole
def test_calibration_times_every_size():
  info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=4, steps=4, repeats=1)
  first = info["first_pass"] or info  # when fewer nodes can pay, their program was timed again
  assert first["sizes"] == [1, 2, 4] and info["sizes"] == [s for s in (1, 2, 4) if s <= info["timed_tree"]]
  assert info["tree_size"] == (info["timed_tree"] if info["tree_pays"] else 1)
  assert all(s > 0 for s in info["seconds"]) and info["beta"] > 0
  assert info["table"][1] == info["seconds"][0]  # the plain step as measured


def test_a_short_run_can_step_in_a_longer_runs_pool():
  """`pool_tokens` sizes the pool for a longer run and changes nothing else: the same tokens, the same steps."""
  short = prepare_run(MODEL, PROMPTS, Sequential(), max_new_tokens=8)
  wide = prepare_run(MODEL, PROMPTS, Sequential(), max_new_tokens=8, pool_tokens=200)
  long = prepare_run(MODEL, PROMPTS, Sequential(), max_new_tokens=200)
  assert wide.cfg.pool_slots == long.cfg.pool_slots > short.cfg.pool_slots
  (a, _), (b, _) = api.run_prepared(short), api.run_prepared(wide)
  assert [tokens_of(r) for r in a] == [tokens_of(r) for r in b] and [r.steps for r in a] == [r.steps for r in b]


def test_calibration_cancels_the_prefill(monkeypatch):
  """A step's time is the difference of a long and a short run over their steps: the prefill both pay (here
  0.5 s against 0.04-0.06 s a step) does not inflate it, and the plain size keeps its own time."""
  from types import SimpleNamespace

  from pasta_jax.decode import latency
  def prepare(model, ids, *, rules, rule_inputs, max_new_tokens, **kw):
    return pinned_size(rules, rule_inputs), max_new_tokens  # (the pinned size, the tokens asked)
  def run(prep):
    size, steps = prep
    return [SimpleNamespace(steps=steps)], 0.5 + steps * (0.04 if size == 1 else 0.02 + 0.01 * size)
  monkeypatch.setattr(latency.api, "prepare", prepare)
  monkeypatch.setattr(latency.api, "run_prepared", run)
  info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=4, steps=8, repeats=1)
  assert info["tree_size"] == 4 and info["first_pass"] is None  # T(4) = 0.06 < 2 T(1): every size can pay
  np.testing.assert_allclose(info["seconds"], [0.04, 0.04, 0.06])
  assert (info["alpha"], info["beta"]) == pytest.approx((0.01, 0.02))
  assert info["table"] == pytest.approx({1: 0.04, 2: 0.04, 4: 0.06})


def test_a_slow_spell_during_calibration_costs_every_size_alike(monkeypatch):
  """The repeats run in rounds over every size: a spell of 3x slower runs as long as one round leaves each size a
  clean round, so the table is the quiet machine's (timing one size's repeats back to back, the spell would land
  on the first sizes alone)."""
  from types import SimpleNamespace

  from pasta_jax.decode import latency
  calls = []
  def prepare(model, ids, *, rules, rule_inputs, max_new_tokens, **kw):
    return pinned_size(rules, rule_inputs), max_new_tokens
  def run(prep):
    size, steps = prep
    calls.append(prep)
    slow = 3.0 if 3 <= len(calls) <= 2 + 6 else 1.0  # after the 2 compiling runs, one round of 3 sizes x 2 runs
    return [SimpleNamespace(steps=steps)], slow * steps * (0.04 if size == 1 else 0.02 + 0.01 * size)
  monkeypatch.setattr(latency.api, "prepare", prepare)
  monkeypatch.setattr(latency.api, "run_prepared", run)
  info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=4, steps=8, repeats=2)
  assert len(calls) == 2 + 2 * 6
  assert info["table"] == pytest.approx({1: 0.04, 2: 0.04, 4: 0.06})


def test_calibration_times_a_smaller_tree_in_its_own_program(monkeypatch):
  """When only a smaller tree can pay, ProPD runs the program compiled for it, whose every step is cheaper (fewer
  lanes to keep): its sizes are timed again there, and the big program's figures stay in `first_pass`."""
  from types import SimpleNamespace

  from pasta_jax.decode import latency
  pools = set()
  def prepare(model, ids, *, rules, rule_inputs, max_new_tokens, pool_tokens, **kw):
    pools.add(pool_tokens)
    return pinned_size(rules, rule_inputs), max_new_tokens, rules.tree.size
  def run(prep):
    size, steps, compiled = prep  # each compiled lane costs 0.01 a step; a tree node 0.05 more
    return [SimpleNamespace(steps=steps)], steps * (0.01 * compiled + (0.0 if size == 1 else 0.05 * size))
  monkeypatch.setattr(latency.api, "prepare", prepare)
  monkeypatch.setattr(latency.api, "run_prepared", run)
  info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=8, steps=8, repeats=1, run_tokens=128)
  assert pools == {128}  # every program steps in the pool of the run it calibrates
  assert info["first_pass"]["tree_size"] == 8
  assert info["first_pass"]["table"] == pytest.approx({1: 0.08, 2: 0.18, 4: 0.28, 8: 0.48})
  assert info["sizes"] == [1, 2] and info["table"] == pytest.approx({1: 0.02, 2: 0.12})
  # T(2) = 6 T(1) in that program: no tree pays at any hit rate, so ProPD is plain decoding there
  assert info["tree_size"] == 1 and not info["tree_pays"]


def test_a_slow_spell_in_the_smaller_programs_pass_is_capped_by_the_bigger_programs_times(monkeypatch):
  """A size's step in the smaller tree's program costs no more than in the bigger one's (fewer lanes to keep): a
  second pass that measured more (the machine slowed down while it ran) takes the first pass's time instead."""
  from types import SimpleNamespace

  from pasta_jax.decode import latency
  monkeypatch.setattr(latency.api, "prepare", lambda model, ids, *, rules, rule_inputs, max_new_tokens, **kw: (
      pinned_size(rules, rule_inputs), max_new_tokens, rules.tree.size))
  def run(prep):  # as the test above, but the 2-node program's size-1 steps ran in a slow spell (x 10)
    size, steps, compiled = prep
    seconds = steps * (0.01 * compiled + (0.0 if size == 1 else 0.05 * size))
    return [SimpleNamespace(steps=steps)], seconds * (10 if (compiled, size) == (2, 1) else 1)
  monkeypatch.setattr(latency.api, "run_prepared", run)
  info = calibrate_latency(MODEL, PROMPTS[:1], drafter(), tree_size=8, steps=8, repeats=1, run_tokens=128)
  assert info["sizes"] == [1, 2] and info["seconds"] == pytest.approx([0.08, 0.12])  # 0.2 measured, 0.08 before
  assert info["table"] == pytest.approx({1: 0.08, 2: 0.12}) and info["capped"] == [1]
  assert latency.cap_by_bigger_program([1, 2], [0.5, 0.1], {"sizes": [1, 2, 4], "seconds": [0.3, 0.2, 0.4]}) == (
      pytest.approx([0.3, 0.1]), [1])


def test_bad_requests_name_the_problem(tmp_path):
  with pytest.raises(PastaError, match="no Medusa heads"):
    generate_ids(MODEL, PROMPTS, Medusa(heads=tmp_path), max_new_tokens=8)
  with pytest.raises(PastaError, match="latency"):  # the layout of a method value not prepared
    Propd(heads=drafter(), tree_size=4).layout(MODEL, None)
  with pytest.raises(PastaError, match="forced"):
    generate_ids(MODEL, PROMPTS, Medusa(heads=drafter()), forced_answers=["a"] * 3)
  with pytest.raises(Exception, match="Medusa heads"):
    generate_ids(MODEL, PROMPTS, Medusa(heads=drafter(num_heads=1), choices=[[0], [0, 0]]))


def test_generate_and_stream_take_tree_methods():
  d = drafter()
  [whole] = generate(MODEL, ["hello"], Medusa(heads=d, tree_size=6), max_new_tokens=20)
  chunks = list(stream(MODEL, ["hello"], Medusa(heads=d, tree_size=6), max_new_tokens=20, chunk_steps=3))
  assert len(chunks) >= 2 and chunks[-1][0].text == whole.text
  assert whole.method == "medusa" and whole.speculation["tree_steps"] > 0
  [plain] = generate(MODEL, ["hello"], Sequential(), max_new_tokens=20)
  assert whole.text == plain.text
  with pytest.raises(TypeError, match="tree_size"):  # an option of the tree methods only
    Pasta(tree_size=4)


def test_eval_methods_use_the_models_heads_and_name_a_missing_one():
  from pasta_jax.commands.eval_registry import eval_methods
  from pasta_jax.eval.methods import DecodeSettings, MethodSpec
  for name in ("medusa", "propd"):
    with pytest.raises(PastaError, match="no Medusa heads for random:tiny-gemma3"):
      eval_methods()[name](MethodSpec(name), MODEL, DecodeSettings())


def test_propd_probes_thin_out_while_head_0_misses_and_come_back_after_a_hit():
  """`probe_schedule`: while no tree is planned, probes come `probe_every` steps apart, twice as far after each
  probe that head 0 misses, up to `probe_max`; a hit of head 0 (`count_hits`) brings the next probe to the next
  step and the gap back to `probe_every`."""
  from types import SimpleNamespace
  rules, inputs = rules_and_inputs(drafter(top_k=4), tree_size=4, dynamic=True, latency={1: 1.0, 2: 1.4, 4: 1.9})
  rules = dataclasses.replace(rules, probe_every=4, probe_max=16)
  d = rules.init_rule_state(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), inputs, SimpleNamespace(lanes=4))
  d = dataclasses.replace(d, have_candidates=jnp.array([True]))
  fed, root_only = jnp.array([True]), jnp.zeros((1,), jnp.int32)
  probed = []
  for step in range(80):
    if step == 41:  # the plain token after the probe at step 40 is head 0's first candidate: a hit
      d = rules.count_hits(d, d, d.candidates[:, 0, :1], fed[:, None], root_only, d.candidates[:, 0, 0],
                           jnp.zeros((1,), jnp.int32), fed)
    probe = rules.probing(d, jnp.int32(step), fed)
    if bool(probe):
      probed.append(step)
    d = rules.probe_schedule(d, jnp.int32(step), fed & probe)
  assert probed == [0, 4, 12, 28, 41, 45, 53, 69]  # gaps 4, 8, 16, 16 (the cap); the hit; 4, 8, 16
  assert int(d.probes[0]) == len(probed)
