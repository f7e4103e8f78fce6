"""Token trees for tree speculation (Medusa, ProPD): which candidate each node holds, and who sees whom.

A tree is a tuple of choices: node () is the root (the token the base model chose last step, certain);
node (r_1, ..., r_d) holds the rank-r_d token of Medusa head d-1, and is a child of (r_1, ..., r_{d-1}).
Nodes are stored parents first, so every prefix of a tree is a tree (ProPD's dynamic sizes cut prefixes)
and along every root-to-leaf path the node indices grow (the interpreter records a path in node order).

On the decode core each node is a one-token transient thread: node i is thread i (the root is main,
thread 0), it sees main's cache and its ancestors' tokens (`ancestors`), and sits at position p + depth.

`build_tree` grows Medusa's tree the way the Medusa paper builds its default one: greedily, each time adding
the node with the highest probability of being accepted, where a node's probability is the product of
its heads' top-k hit rates along its path (measured on a calibration set). Under that independence model
the greedy tree maximises the expected accepted length for its size, and so does each of its prefixes.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from pasta_jax.errors import PastaError

Choice = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TokenTree:
  """A static token tree (hashable: part of a jit-static rule). choices[0] is the root ()."""

  choices: tuple[Choice, ...]

  def __post_init__(self):
    choices = tuple(tuple(int(r) for r in c) for c in self.choices)
    object.__setattr__(self, "choices", choices)
    if not choices or choices[0] != ():
      raise PastaError("a token tree starts with its root, the empty choice ()")
    seen = set()
    for c in choices:
      if c in seen:
        raise PastaError(f"token tree: choice {list(c)} appears twice")
      if c and c[:-1] not in seen:
        raise PastaError(f"token tree: choice {list(c)} comes before its parent {list(c[:-1])} (list parents first)")
      if any(r < 0 for r in c):
        raise PastaError(f"token tree: negative rank in choice {list(c)}")
      seen.add(c)

  @classmethod
  def from_choices(cls, choices: Sequence[Sequence[int]]) -> TokenTree:
    """A tree from a Medusa-style choices list (root implied; any order): sorted parents first."""
    body = sorted({tuple(c) for c in choices if len(c)}, key=lambda c: (len(c), c))
    return cls(((),) + tuple(body))

  @property
  def size(self) -> int:
    return len(self.choices)

  @property
  def depth(self) -> np.ndarray:
    """[N] int32: the root's is 0."""
    return np.array([len(c) for c in self.choices], np.int32)

  @property
  def max_depth(self) -> int:
    return int(self.depth.max())

  @property
  def max_rank(self) -> int:
    """Candidates per head the tree reads (top-k with k = this)."""
    return 1 + max((max(c) for c in self.choices if c), default=0)

  @property
  def parent(self) -> np.ndarray:
    """[N] int32 node index of each node's parent (-1: the root)."""
    index = {c: i for i, c in enumerate(self.choices)}
    return np.array([index[c[:-1]] if c else -1 for c in self.choices], np.int32)

  @property
  def rank(self) -> np.ndarray:
    """[N] int32 the head rank each node reads (the root: 0, unused)."""
    return np.array([c[-1] if c else 0 for c in self.choices], np.int32)

  @property
  def ancestors(self) -> np.ndarray:
    """[N, N] bool: node i sees node j (j is i or an ancestor of i)."""
    index = {c: i for i, c in enumerate(self.choices)}
    out = np.zeros((self.size, self.size), bool)
    for i, c in enumerate(self.choices):
      for d in range(len(c) + 1):
        out[i, index[c[:d]]] = True
    return out

  def prefix(self, size: int) -> TokenTree:
    return TokenTree(self.choices[:size])

  def check_heads(self, num_heads: int, top_k: int) -> None:
    if self.max_depth > num_heads:
      raise PastaError(f"the tree is {self.max_depth} deep but there are only {num_heads} Medusa heads")
    if self.max_rank > top_k:
      raise PastaError(f"the tree reads rank {self.max_rank - 1} but candidates keep the top {top_k}")


def node_probabilities(tree: TokenTree, hit_rates: np.ndarray) -> np.ndarray:
  """[N] probability that each node is accepted: the product of hit_rates[d, r_d] along its path
  (hit_rates [K, k]: head d's rank-r token is the right one). The root's is 1."""
  rates = np.asarray(hit_rates, np.float64)
  return np.array([np.prod([rates[d, r] for d, r in enumerate(c)]) if c else 1.0 for c in tree.choices])


def expected_accept_length(tree: TokenTree, hit_rates: np.ndarray) -> float:
  """Tokens a step of this tree writes, on average: the root's successor plus every accepted node."""
  return float(node_probabilities(tree, hit_rates).sum())


def build_tree(hit_rates: np.ndarray, size: int) -> TokenTree:
  """The greedy tree of `size` nodes (root included) for heads with top-k hit rates [K, k]."""
  rates = np.asarray(hit_rates, np.float64)
  if rates.ndim != 2 or size < 1:
    raise PastaError(f"build_tree needs hit rates [K, k] and size >= 1, got {rates.shape} and {size}")
  heads, top_k = rates.shape
  chosen: list[Choice] = [()]
  frontier = [(-rates[0, r], (r,)) for r in range(top_k)] if heads else []
  heapq.heapify(frontier)
  while frontier and len(chosen) < size:
    neg_p, choice = heapq.heappop(frontier)
    chosen.append(choice)
    if len(choice) < heads:
      for r in range(top_k):
        heapq.heappush(frontier, (neg_p * rates[len(choice), r], choice + (r,)))
  return TokenTree(tuple(chosen))


def default_hit_rates(num_heads: int, top_k: int) -> np.ndarray:
  """A prior for heads with no calibration: head d's rank-r hit rate 0.6 * 0.8^d / (r + 1)^1.5, roughly the
  shape of the per-head accuracies the Medusa paper reports (top-1 falling with depth, top-k with rank)."""
  d = np.arange(num_heads)[:, None]
  r = np.arange(top_k)[None, :]
  return 0.6 * 0.8 ** d / (r + 1.0) ** 1.5
