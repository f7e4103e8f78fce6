"""A pure-Python Superposed Decoding (paper 002, Algorithm 1 with tensor2tensor's alive/finished sets),
the oracle of tests/test_superposed.py: lists and floats on the host, n-grams by brute-force counting,
and every step a full recompute of the model over the prompt and the superposed rows so far (no pool).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pasta_jax.model.gemma import causal_mask

UNKNOWN = -2


def brute_count(corpus: list[list[int]], key: list[int]) -> int:
  n = len(key)
  return sum(doc[i:i + n] == key for doc in corpus for i in range(len(doc) - n + 1))


def brute_followed(corpus: list[list[int]], ctx: list[int]) -> int:
  """Occurrences of ctx followed by a token of the same document."""
  n = len(ctx)
  return sum(doc[i:i + n] == ctx for doc in corpus for i in range(len(doc) - n))


def p_ngram(corpus, context: list[int], token: int, weights) -> float:
  total = 0.0
  for n, weight in zip(range(2, len(context) + 2), weights):
    ctx = context[len(context) - (n - 1):]
    if UNKNOWN in ctx:
      continue
    followed = brute_followed(corpus, ctx)
    if followed:
      total += weight * brute_count(corpus, ctx + [token]) / followed
  return total


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max()
  return x - m - math.log(np.exp(x - m).sum())


def superposed_reference(apply, params, prompt: list[int], *, k: int, candidates: int, tau: float, alpha: float,
                         weights, corpus, eos: set[int], max_new: int, log_delta: float = -200.0):
  """Returns the ranked drafts [(tokens, score, finished)] and whether the search settled (finished)."""
  width = len(weights)
  rows_ids, rows_w = [[t] * k for t in prompt], [[1.0] + [0.0] * (k - 1) for _ in prompt]

  def last_logits():
    n = len(rows_ids)
    ids, w = jnp.asarray([rows_ids]), jnp.asarray([rows_w], jnp.float32)
    logits = apply(params, ids, jnp.arange(n)[None], causal_mask(1, n), token_weights=w).logits
    return np.asarray(logits[0, -1])

  alive = [([], 0.0)]  # (tokens, log p)
  done: list[tuple[list[int], float]] = []
  logits = last_logits()
  settled = False
  while True:
    lp = log_softmax(logits / tau)
    cand = sorted(range(lp.size), key=lambda v: -lp[v])[:candidates]
    options = []  # (score, flat index, parent, token)
    for i, (toks, score) in enumerate(alive):
      ctx = ([UNKNOWN] * width + prompt + toks)[-width:]
      for j, x in enumerate(cand):
        step = lp[x]
        if alpha > 0 and toks:
          p = p_ngram(corpus, ctx, x, weights)
          step = (1 - alpha) * step + (alpha * math.log(p) if p > 0 else log_delta)
        options.append((score + step, i * candidates + j, i, x))
    top = sorted(options, key=lambda o: (-o[0], o[1]))[: 2 * k]
    ended = [(alive[o[2]][0], o[0]) for o in top if o[3] in eos]
    alive = [(alive[o[2]][0] + [o[3]], o[0]) for o in top if o[3] not in eos][:k]
    done = sorted(done + ended, key=lambda d: -d[1])[:k]  # stable: earlier entries first on ties
    if not alive or (len(done) == k and min(d[1] for d in done) >= alive[0][1]):
      settled = True
      break
    if len(alive[0][0]) >= max_new:
      break
    scores = np.array([s for _, s in alive])
    gamma = np.exp(scores - scores.max())
    gamma = gamma / gamma.sum()
    newest = [t[-1] for t, _ in alive]
    pad = k - len(alive)
    rows_ids.append(newest + [0] * pad)
    rows_w.append(list(gamma) + [0.0] * pad)
    logits = last_logits()
  ranked = sorted([(t, s, True) for t, s in done] + [(t, s, False) for t, s in alive], key=lambda d: -d[1])
  return ranked[:k], settled
