"""An n-gram index over a tokenized corpus: counts of any context and its continuations, on host or device.

The corpus is one int32 array, documents separated by SEP. `order` lists every position of it sorted by
the `max_n` tokens that start there (a suffix array cut at depth max_n: for keys of at most max_n tokens
it answers exactly what a full suffix array answers, and builds with one lexsort). All positions whose
window starts with a key form one run of `order`; two binary searches find it, so count(key) costs
2 log2(N) window comparisons, the same arithmetic on the host (numpy) and on device (jax, inside the
decode loop: Superposed Decoding reads it every step without leaving the device).

Superposed Decoding's smoothing (`interpolated`, paper 002 section 3.2): for a draft's context c and a
candidate x, p_ngram(x) = sum_n lambda_n * count(c[-(n-1):] x) / count(c[-(n-1):] .) over n = 2..6,
where count(c .) counts the context followed by a token (not by a document's end), and an order whose
context never occurs in the corpus (or reaches before the prompt) is skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SEP = -1  # between documents: no n-gram crosses it
UNKNOWN = -2  # context padding before the prompt's first token: never in the corpus, so those orders skip
PAPER_WEIGHTS = (0.01, 0.04, 0.15, 0.18, 0.12)  # lambda_n for n = 2..6 (paper 002, Appendix B)
FORMAT = 1
ENV = "PASTA_NGRAM_DIR"


def default_index_dir() -> Path:
  """Where `pasta ngram build` writes by default and Superposed Decoding looks ($PASTA_NGRAM_DIR moves it)."""
  return Path(os.environ.get(ENV) or Path.home() / ".cache" / "pasta_jax" / "ngram" / "default")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramArrays:
  """The index as arrays (numpy on the host, jax on device): what `count` reads."""

  tokens: jax.Array  # [N + max_n] int32 corpus, SEP-padded so every window is in bounds
  order: jax.Array  # [N] int32 positions sorted by their max_n-token windows


@dataclasses.dataclass(frozen=True)
class NgramIndex:
  arrays: NgramArrays  # numpy arrays
  max_n: int
  meta: dict  # corpus names, documents, build settings

  @property
  def num_tokens(self) -> int:
    return int(self.arrays.order.shape[0])

  @property
  def nbytes(self) -> int:
    return int(self.arrays.tokens.nbytes + self.arrays.order.nbytes)

  @classmethod
  def build(cls, documents: Iterable[Sequence[int]], max_n: int = 6, meta: dict | None = None) -> NgramIndex:
    """Index token-id documents (each a sequence of non-negative ids)."""
    parts, num_docs = [], 0
    for doc in documents:
      ids = np.asarray(doc, np.int32)
      if ids.size and ids.min() < 0:
        raise ValueError(f"document {num_docs}: token ids must be non-negative, got {int(ids.min())}")
      parts += [ids, np.array([SEP], np.int32)]
      num_docs += 1
    corpus = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    padded = np.concatenate([corpus, np.full((max_n,), SEP, np.int32)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, max_n)[: corpus.size]  # [N, max_n] views
    order = np.lexsort(windows.T[::-1]).astype(np.int32)  # lexsort's last key is the primary one
    info = {"format": FORMAT, "documents": num_docs, "tokens": int(corpus.size), **(meta or {})}
    return cls(NgramArrays(padded, order), max_n, info)

  def save(self, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "tokens.npy", self.arrays.tokens)
    np.save(folder / "order.npy", self.arrays.order)
    (folder / "index.json").write_text(json.dumps({**self.meta, "max_n": self.max_n}, indent=1))
    return folder

  @classmethod
  def load(cls, folder: str | Path) -> NgramIndex:
    folder = Path(folder)
    if not (folder / "index.json").is_file():
      raise FileNotFoundError(f"{folder} holds no n-gram index (build one: pasta ngram build CORPUS --out {folder})")
    meta = json.loads((folder / "index.json").read_text())
    if meta.get("format") != FORMAT:
      raise ValueError(f"{folder}: n-gram index format {meta.get('format')}, this version reads {FORMAT}")
    arrays = NgramArrays(np.load(folder / "tokens.npy"), np.load(folder / "order.npy"))
    return cls(arrays, int(meta.pop("max_n")), meta)

  def device_arrays(self) -> NgramArrays:
    """The arrays on the default device, copied once per index (every generate call reuses them)."""
    if "_on_device" not in self.__dict__:  # frozen: cache beside the fields, as functools.cached_property does
      self.__dict__["_on_device"] = jax.tree.map(jnp.asarray, self.arrays)
    return self.__dict__["_on_device"]

  def count(self, keys: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Host counts: keys [..., L] (the first `lengths` [...] tokens of each row), L <= max_n."""
    return np.asarray(count(self.arrays, np.asarray(keys, np.int32), np.asarray(lengths, np.int32), xp=np))


def _compare(arrays: NgramArrays, at: jax.Array, keys: jax.Array, lengths: jax.Array, xp) -> jax.Array:
  """Sign of (window at position `at`) - key over the key's first `lengths` tokens: [...] in {-1, 0, 1}."""
  width = keys.shape[-1]
  window = arrays.tokens[at[..., None] + xp.arange(width)]  # [..., L]
  diff = xp.sign(window - keys) * (xp.arange(width) < lengths[..., None])
  first = xp.argmax(diff != 0, axis=-1)
  return xp.take_along_axis(diff, first[..., None], axis=-1)[..., 0]


def _bound(arrays: NgramArrays, keys, lengths, upper: bool, xp):
  """First index of `order` whose window is >= key (or > key when `upper`), for each key."""
  size = arrays.order.shape[0]
  lo = xp.zeros(keys.shape[:-1], np.int32)
  hi = xp.full(keys.shape[:-1], size, np.int32)

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    cmp = _compare(arrays, arrays.order[xp.minimum(mid, size - 1)], keys, lengths, xp)
    go_right = ((cmp <= 0) if upper else (cmp < 0)) & (lo < hi)
    return xp.where(go_right, mid + 1, lo), xp.where(go_right | (lo >= hi), hi, mid)

  steps = max(size, 1).bit_length()  # fixed trip count: the same program for every key
  if xp is jnp:
    return jax.lax.fori_loop(0, steps, halve, (lo, hi))[0]
  for i in range(steps):
    lo, hi = halve(i, (lo, hi))
  return lo


def count(arrays: NgramArrays, keys, lengths, xp=jnp):
  """How often each key occurs in the corpus. keys: [..., L] int32 (first `lengths` tokens used; a key of
  length 0 counts every position). Works under jit (xp=jnp) and on the host (xp=np)."""
  if arrays.order.shape[0] == 0:
    return xp.zeros(keys.shape[:-1], np.int32)
  return _bound(arrays, keys, lengths, True, xp) - _bound(arrays, keys, lengths, False, xp)


def interpolated(arrays: NgramArrays, context, candidates, weights: Sequence[float] = PAPER_WEIGHTS, xp=jnp):
  """p_ngram of each candidate after each context. context: [..., C] int32, the last C tokens (UNKNOWN
  before the prompt); candidates: [..., M] int32. Returns [..., M] float32 (0 where no order matched).
  Orders n = 2 .. len(weights) + 1 (at most C + 1)."""
  ctx_len = context.shape[-1]
  total = xp.zeros(candidates.shape, np.float32)
  for n, weight in zip(range(2, ctx_len + 2), weights):
    ctx = context[..., ctx_len - (n - 1):]  # [..., n-1]
    ctx_keys = xp.concatenate([ctx, xp.full(ctx.shape[:-1] + (1,), SEP, np.int32)], axis=-1)
    full = xp.full(ctx.shape[:-1], n - 1, np.int32)
    followed = count(arrays, ctx_keys, full, xp) - count(arrays, ctx_keys, full + 1, xp)  # ctx then a token
    grams = xp.concatenate([xp.broadcast_to(ctx[..., None, :], candidates.shape + (n - 1,)), candidates[..., None]],
                           axis=-1)  # [..., M, n]
    hits = count(arrays, grams, xp.full(candidates.shape, n, np.int32), xp)
    prob = hits / xp.maximum(followed, 1)[..., None]
    total = total + weight * xp.where(followed[..., None] > 0, prob, 0.0).astype(np.float32)
  return total
