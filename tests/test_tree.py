"""Token trees (decode/tree.py): structure from a choices list, and Medusa's greedy tree builder."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.tree import TokenTree, build_tree, default_hit_rates, expected_accept_length
from pasta_jax.errors import PastaError


@st.composite
def choices_lists(draw, max_depth=4, max_rank=4, max_nodes=24):
  """Random Medusa choices lists: every node's prefixes are in the list too."""
  nodes: set[tuple[int, ...]] = set()
  for _ in range(draw(st.integers(0, max_nodes))):
    path = tuple(draw(st.lists(st.integers(0, max_rank - 1), min_size=1, max_size=max_depth)))
    nodes.update(path[:d] for d in range(1, len(path) + 1))
  listed = [list(c) for c in nodes]
  return draw(st.permutations(listed)) if listed else listed


@settings(max_examples=60, deadline=None)
@given(choices_lists())
def test_structure_equals_brute_force_from_the_choices(choices):
  tree = TokenTree.from_choices(choices)
  assert tree.size == len(choices) + 1 and tree.choices[0] == ()
  index = {c: i for i, c in enumerate(tree.choices)}
  for i, c in enumerate(tree.choices):
    assert tree.depth[i] == len(c)
    assert tree.parent[i] == (index[c[:-1]] if c else -1)
    assert tree.parent[i] < i  # parents first: every prefix of the tree is a tree
    for j, other in enumerate(tree.choices):
      assert tree.ancestors[i, j] == (other == c[:len(other)])
  for size in range(1, tree.size + 1):
    TokenTree(tree.choices[:size])  # validates


def test_bad_trees_name_the_problem():
  with pytest.raises(PastaError, match="root"):
    TokenTree(((0,),))
  with pytest.raises(PastaError, match="parent"):
    TokenTree(((), (0, 1)))
  with pytest.raises(PastaError, match="twice"):
    TokenTree(((), (0,), (0,)))
  with pytest.raises(PastaError, match="Medusa heads"):
    TokenTree(((), (0,), (0, 0))).check_heads(num_heads=1, top_k=4)


def closed_subtrees(full: TokenTree, size: int):
  """Every sub-tree of `full` with `size` nodes that holds the root and each node's parent."""
  body = full.choices[1:]
  for pick in itertools.combinations(body, size - 1):
    chosen = set(pick)
    if all(len(c) == 1 or c[:-1] in chosen for c in pick):
      yield TokenTree.from_choices(pick)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), st.integers(1, 7))
def test_greedy_tree_is_the_best_tree_of_its_size(rates, size):
  hit_rates = np.asarray(rates).reshape(2, 3) / 3  # a head's rank rates sum to <= 1
  tree = build_tree(hit_rates, size)
  full = TokenTree.from_choices([c for d in (1, 2) for c in itertools.product(range(3), repeat=d)])
  best = max(expected_accept_length(t, hit_rates) for t in closed_subtrees(full, tree.size))
  assert expected_accept_length(tree, hit_rates) == pytest.approx(best)
  assert tree.size == min(size, full.size)


def test_default_tree_is_medusa_sized_and_deepens_along_likely_ranks():
  tree = build_tree(default_hit_rates(4, 10), 64)
  assert tree.size == 64 and tree.max_depth == 4
  assert (0,) in tree.choices and (0, 0, 0, 0) in tree.choices
