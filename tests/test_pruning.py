"""ProPD's early pruning (decode/rules/pruning.py, model.gemma.RowSelect) on the one decode core.

Oracles: the model's own call on every row (kept rows' logits must not change), a brute-force walk of the tree
(which nodes survive), and plain greedy decoding (pruning must never change what greedy tree decoding writes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.rules import pruning
from pasta_jax.decode.rules.pruning import EarlyPrune
from pasta_jax.decode.speculation import PROPD_PRUNE, early_prune, rules_and_inputs
from pasta_jax.decode.tree import TokenTree
from pasta_jax.errors import PastaError
from pasta_jax.methods import Medusa, Propd, Sequential, generate_ids
from pasta_jax.model.gemma import RowSelect
from pasta_jax.visibility import ThreadMask
from tests.test_medusa import MODEL, PROMPTS, assert_same_greedy, drafter, plain_greedy, tokens_of, tree_step
from tests.test_tree import choices_lists

LAYER = 1  # the tiny model has 3 layers


# --- the model: only the kept rows run the deep layers ------------------------------------------------
@settings(max_examples=2, deadline=None)
@given(choices_lists(max_depth=3, max_rank=3, max_nodes=8), st.data())
def test_kept_rows_equal_the_full_call_and_pruned_rows_write_no_deep_kv(choices, data):
  tree = TokenTree.from_choices(choices)
  state, fed, prep, _ = tree_step(tree, [2, 9, 8, 7, 6])
  n = tree.size
  keep = data.draw(st.integers(1, n))
  alive = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
  alive[0] = True
  for i in range(1, n):  # as pruning keeps them: a node's ancestors too (parents come first)
    alive[i] &= alive[tree.parent[i]]
  rows, ok = pruning.first_rows(jnp.asarray(alive)[None], keep)
  select = RowSelect(LAYER, keep, lambda x, tokens: (rows, ok))
  mask = ThreadMask(state.horizon, state.slot_owner, state.slot_order, state.slot_valid)
  args = (prep.params, state.token, state.position, mask, state.pool, fed.slots, state.slot_pos)
  full = prep.model_fn(*args, return_hidden=True)
  pruned = prep.model_fn(*args, return_hidden=True, row_select=select)
  full_logits, full_hidden = full.logits, full.head_input
  logits, pool, hidden, kept = pruned.logits, pruned.kv, pruned.head_input, pruned.kept
  expected_kept = np.zeros(n, bool)
  expected_kept[np.flatnonzero(alive)[:keep]] = True
  np.testing.assert_array_equal(kept[0], expected_kept)
  np.testing.assert_allclose(logits[0, expected_kept], full_logits[0, expected_kept], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(hidden[0, expected_kept], full_hidden[0, expected_kept], rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(logits[0, ~expected_kept]))
  slots = np.asarray(fed.slots[0])
  deep = np.asarray(pool.k[LAYER:, 0])  # [L - LAYER, S, K, hd]
  assert np.all(deep[:, slots[~expected_kept]] == 0) and np.all(np.any(deep[:, slots[expected_kept]] != 0, (2, 3)))
  assert np.all(np.any(np.asarray(pool.k[:LAYER, 0])[:, slots] != 0, axis=(2, 3)))  # early layers: every node


def test_row_select_refuses_what_it_cannot_prune():
  state, fed, prep, _ = tree_step(TokenTree.from_choices([[0], [1]]), [2, 9, 8])
  mask = ThreadMask(state.horizon, state.slot_owner, state.slot_order, state.slot_valid)
  select = RowSelect(3, 1, lambda x, tokens: (jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool)))
  with pytest.raises(ValueError, match="row_select.layer must be in"):
    prep.model_fn(prep.params, state.token, state.position, mask, state.pool, fed.slots, state.slot_pos,
                  row_select=select)


# --- which nodes survive --------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(choices_lists(max_depth=4, max_rank=3, max_nodes=16), st.data())
def test_surviving_nodes_equal_a_brute_force_walk(choices, data):
  tree = TokenTree.from_choices(choices)
  n, k = tree.size, 3
  tokens = np.asarray(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
  top = np.asarray(data.draw(st.lists(st.lists(st.integers(0, 5), min_size=k, max_size=k), min_size=n,
                                      max_size=n)))
  alive = np.asarray(pruning.surviving_nodes(jnp.asarray(top)[None], jnp.asarray(tokens)[None], tree.parent,
                                             tree.depth))[0]
  index = {c: i for i, c in enumerate(tree.choices)}
  for i, c in enumerate(tree.choices):  # alive iff every node on the path is on its parent's list
    path = [index[c[:d]] for d in range(1, len(c) + 1)]
    expected = all(tokens[j] in top[index[tree.choices[j][:-1]]] for j in path)
    assert alive[i] == expected, (c, alive[i])
  keep = min(4, n)  # M <= Q
  rows, ok = pruning.first_rows(jnp.asarray(alive)[None], keep)
  expected_rows = np.flatnonzero(alive)[:keep]
  assert np.asarray(rows[0, : len(expected_rows)]).tolist() == expected_rows.tolist()
  assert np.asarray(ok[0]).tolist() == [True] * len(expected_rows) + [False] * (keep - len(expected_rows))


def test_settings_and_rows_kept():
  p = EarlyPrune(layer=4, top_k=50, keep=0.5, min_size=4)
  assert [p.rows_kept(q) for q in (1, 2, 4, 8, 64)] == [1, 2, 2, 4, 32]
  with pytest.raises(ValueError):
    EarlyPrune(keep=0.0)


def test_logit_lens_head_is_the_final_norm_and_output_head():
  scale = jax.random.normal(jax.random.key(0), (MODEL.config.embed_dim,))
  x = jax.random.normal(jax.random.key(1), (2, 3, MODEL.config.embed_dim))
  unembed = MODEL.params["params"]["embedder"]
  got = pruning.early_head_logits(pruning.logit_lens_head(scale), x, unembed)
  normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + scale)
  np.testing.assert_allclose(got, normed @ unembed.T, rtol=1e-4, atol=1e-4)


def test_early_head_save_and_load(tmp_path):
  head = {k: np.asarray(v) + 0.5 for k, v in pruning.logit_lens_head(jnp.ones(8)).items()}
  pruning.save_early_head(tmp_path, head, {"layer": 4})
  loaded, layer = pruning.load_early_head(tmp_path)
  assert layer == 4
  for k in head:
    np.testing.assert_array_equal(loaded[k], head[k])
  assert pruning.load_early_head(tmp_path / "none") is None


# --- whole runs: lossless, and really pruning -----------------------------------------------------------
PRUNE = EarlyPrune(layer=LAYER, top_k=24, keep=0.5, min_size=4)


@settings(max_examples=2, deadline=None)
@given(choices_lists(max_depth=3, max_rank=4, max_nodes=12), st.integers(0, 3))
def test_greedy_tree_decoding_with_early_pruning_is_plain_greedy_decoding(choices, seed):
  results = generate_ids(MODEL, PROMPTS, Medusa(heads=drafter(seed=seed), choices=choices, prune=PRUNE),
                         max_new_tokens=48)
  assert_same_greedy(plain_greedy(), results)


def test_pruning_cuts_nodes_and_keeps_accepting_paths():
  """Not vacuous: nodes are cut (by the early lists and by the row budget), paths are still accepted, and greedy
  is unchanged; with pruning off nothing is cut."""
  d = drafter(seed=0, scale=0.05)
  pruned = generate_ids(MODEL, PROMPTS, Medusa(heads=d, tree_size=8, prune=PRUNE), max_new_tokens=48)
  whole = generate_ids(MODEL, PROMPTS, Medusa(heads=d, tree_size=8, prune=False), max_new_tokens=48)
  assert_same_greedy(plain_greedy(), pruned)
  assert min(r.speculation["prune_rate"] for r in pruned) > 0.3
  assert all(r.speculation["prune_rate"] == 0 for r in whole)
  assert max(r.speculation["accept_length"] for r in pruned) > 1.3
  assert [tokens_of(r) for r in pruned] == [tokens_of(r) for r in whole]


def test_propd_prunes_by_default_only_with_a_trained_early_head_and_options_are_checked():
  plain, trained = drafter(), dataclasses.replace(drafter(), early_head=logit_lens_numpy(), early_layer=LAYER)
  assert early_prune(True, None, plain) is None  # the logit lens alone is no default
  assert early_prune(True, None, trained) == dataclasses.replace(PROPD_PRUNE, layer=LAYER)
  assert early_prune(False, None, trained) is None and early_prune(True, False, trained) is None
  with pytest.raises(PastaError, match="reads layer 1, not 2"):
    early_prune(True, dataclasses.replace(PRUNE, layer=2), trained)
  rules, inputs = rules_and_inputs(trained, tree_size=8, dynamic=True, latency=(1.0, 1.0), prune=PRUNE)
  assert rules.prune == PRUNE and set(inputs["early"]) == set(pruning.EARLY_HEAD_KEYS)
  runs = generate_ids(MODEL, PROMPTS[:1], Propd(heads=plain, tree_size=8, latency=(1e-06, 1.0),
                                                prune=dataclasses.replace(PRUNE, top_k=4)), max_new_tokens=16)
  assert_same_greedy(plain_greedy()[:1], runs)
  assert runs[0].speculation["prune_rate"] > 0
  with pytest.raises(PastaError, match="prune must be"):
    generate_ids(MODEL, PROMPTS[:1], Propd(heads=plain, latency=(1.0, 1.0), prune="yes"))
  with pytest.raises(TypeError, match="prune"):  # an option of the tree methods only
    Sequential(prune=PRUNE)


def logit_lens_numpy():
  return {k: np.asarray(v) for k, v in pruning.logit_lens_head(jnp.zeros(MODEL.config.embed_dim)).items()}
