"""APAR's paragraph tree on token ids: tree order <-> per-thread scripts <-> interpreter records.

Tree order (APAR's RESTORE) writes each child right after its parent's fork:
  main: a b FORK c EOS, child: x y EOS   ->   a b FORK CHILD x y EOS c EOS
Thread ids are given at run time in spawn order, which depends on the schedule (a fork waits for a
free lane), so `thread_scripts` replays the interpreter's scheduling rule on the tree to number the
threads exactly as the interpreter will (decode/rules/apar.py: the k-th forking lane takes the k-th free
lane and the next thread id; an end id frees its lane at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pasta_jax.errors import TagError
from pasta_jax.lang.schema import THREAD, TOKEN
from pasta_jax.lang.tags import TagVocab


@dataclasses.dataclass
class Node:
  """One thread's own tokens (forks included, CHILD and its end id excluded) and its children,
  the k-th child belonging to the k-th fork."""

  tokens: list[int] = dataclasses.field(default_factory=list)
  children: list[Node] = dataclasses.field(default_factory=list)


def parse_tree(ids: Sequence[int], vocab: TagVocab) -> Node:
  """Tree-order ids (main's end id optional) -> the root node. A fork must be followed by CHILD,
  and every child must end with an end id; errors name the token index."""
  ids = list(ids)

  def read(start: int, is_child: bool) -> tuple[Node, int]:
    node, i = Node(), start
    while i < len(ids):
      token = ids[i]
      if token in vocab.eos_ids:
        return node, i + 1
      if token == vocab.apar_child:
        raise TagError(f"token {i}: APAR child token without a fork before it")
      node.tokens.append(token)
      i += 1
      if token == vocab.apar_fork:
        if i >= len(ids) or ids[i] != vocab.apar_child:
          raise TagError(f"token {i - 1}: APAR fork not followed by a child token")
        child, i = read(i + 1, True)
        node.children.append(child)
    if is_child:
      raise TagError(f"token {start}: APAR child never ends (no end id before the answer ends)")
    return node, i

  root, _ = read(0, False)
  return root


def thread_scripts(root: Node, vocab: TagVocab, lanes: int, max_threads: int) -> list[list[int]]:
  """Per-thread forced scripts (own tokens + end id), numbered in the interpreter's spawn order."""
  scripts: list[list[int]] = [root.tokens + [vocab.eos_ids[0]]]
  lane_nodes: list[tuple[Node, int] | None] = [(root, 0)] + [None] * (lanes - 1)  # (node, next index)
  forks_done: dict[int, int] = {}  # id(node) -> children spawned
  while any(x is not None for x in lane_nodes):
    pending = [(i, x) for i, x in enumerate(lane_nodes) if x is not None]
    forking = [i for i, (node, k) in pending if k < len(node.tokens) and node.tokens[k] == vocab.apar_fork]
    free = [i for i in range(1, lanes) if lane_nodes[i] is None]
    can = max(0, min(len(forking), len(free), max_threads - len(scripts)))
    stalled = set(forking[can:])
    for parent_lane, target in zip(forking[:can], free[:can], strict=True):
      node = lane_nodes[parent_lane][0]
      child = node.children[forks_done.get(id(node), 0)]
      forks_done[id(node)] = forks_done.get(id(node), 0) + 1
      scripts.append(child.tokens + [vocab.eos_ids[0]])
      lane_nodes[target] = (child, -1)  # -1: CHILD feeds this step
    if not can and len(stalled) == len(pending):
      break  # every thread waits on a fork that can never spawn (no thread id left)
    for i, x in enumerate(lane_nodes):
      if x is None or i in stalled:
        continue
      node, k = x
      lane_nodes[i] = None if k + 1 >= len(node.tokens) else (node, k + 1)  # fed k; next is k + 1 or the end
  return scripts


def tree_order(records: np.ndarray, parents: np.ndarray, vocab: TagVocab) -> list[int]:
  """A run's tokens in tree order (inserted CHILD tokens and each thread's end id included)."""
  own = {int(u): [int(t) for t in records[records[:, THREAD] == u, TOKEN]] for u in np.unique(records[:, THREAD])}
  kids: dict[int, list[int]] = {}
  for thread, parent in enumerate(parents.tolist()):
    if parent >= 0 and thread in own:
      kids.setdefault(parent, []).append(thread)

  def walk(thread: int) -> list[int]:
    out, children = [], iter(kids.get(thread, []))
    for token in own.get(thread, []):
      out.append(token)
      if token == vocab.apar_fork:
        child = next(children, None)
        if child is not None:
          out += walk(child)
    return out

  return walk(0)


def critical_path(root: Node, vocab: TagVocab) -> int:
  """Steps of an unlimited-lane APAR run (each thread's tokens fed one per step): a child's CHILD
  feeds in the step its fork feeds, so the child's own tokens follow from the fork's step + 1."""

  def finish(node: Node, start: int) -> int:
    end, children = start + len(node.tokens), iter(node.children)
    for k, token in enumerate(node.tokens):
      if token == vocab.apar_fork:
        child = next(children, None)
        if child is not None:
          end = max(end, finish(child, start + k + 1))  # CHILD feeds with the fork, its tokens after
    return end

  return finish(root, 0)
