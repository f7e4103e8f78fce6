"""The certified narrow head: greedy choices of the float32 output head at the cost of a bfloat16 or int8 one.

On a CPU the output head (262k x 640 on Gemma 3 270M) is most of a step, and a step of 2-8 query rows reads
it in float32 at YNNPACK's slower multi-row rate (docs/interpreter.md, "Weight layout of the step"). A bfloat16
copy halves the bytes, but its greedy tokens differ from float32's where the top two logits are close. This
head keeps the float32 choice exactly:

1. approximate logits l~ = n(x) . n(w_v) for every row and token v, where n rounds to the narrow copy: bfloat16
   with float32 accumulation, or int8 (`model/int8_head.py`: a scale per token, two int8 levels per row, exact
   integer sums);
2. a rigorous bound |x . w_v - l~_v| <= b_v = |x| |w_v - n(w_v)| + (|x - n(x)| + D 2^-23 |x|) |n(w_v)|
   (x . w = x . (w - n(w)) + (x - n(x)) . n(w) + n(x) . n(w): Cauchy-Schwarz on each rounding, plus the float32
   arithmetic's error), from two per-token norms precomputed once (`bound_rows`);
3. the K tokens of largest upper bound l~ + b get their exact float32 logit x . w_v; every other token keeps its
   upper bound l~ + b ("mixed" logits).

Whatever monotone per-token change the interpreter applies next (the repetition penalty, the grammar's -inf,
a softcap), an argmax that lands on one of the K exact tokens is the float32 argmax: every other token's true
value lies below its bound, which lost. An argmax that lands on a bound is not certified: that step's rows are
chosen again from the float32 head (`decode.step`). On reference answers teacher-forced through the tuned 270M,
every position has at most 16 candidates under the bfloat16 bound, and 96% under the int8 one (99.3% at most 32,
all at most 64; `python -m bench.head_precision`), so the fallback is rare. One row alone (batch 1, one
lane) takes the float32 head directly: its gemv reads the float32 head as fast as the narrow one. So do the row
counts where this machine's narrow head is not clearly faster (`model/head_plan.py`, `plan.exact_at`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pasta_jax.model import int8_head
from pasta_jax.model.gemma import HEAD_COPY, narrow_head, output_head, softcap
from pasta_jax.model.head_plan import FIXED, HeadPlan

BOUNDS = "unembed_bounds"  # decode params: {"rounding": [V] |w_v - n(w_v)|, "norm": [V] |n(w_v)|}
HEAD_SCALE = "unembed_scale"  # decode params of an int8 copy: [V] its per-token scale
CANDIDATES = 32  # K: tokens whose exact logit is computed per row (16 left 4% of int8 rows uncertified)
BLOCK = 128  # `top_ids`'s first level: the maximum of each BLOCK tokens
ACCUMULATION = 2.0**-23  # float32's unit roundoff, per accumulated product (a loose, safe bound)


def narrow_params(embedding: jax.Array, head_dtype: str) -> dict:
  """What a certified head adds to the decode params for embedding [V, D] float32: the narrow copy (HEAD_COPY,
  [D, V]), an int8 copy's scales (HEAD_SCALE) and the bound's per-token norms (BOUNDS)."""
  if jnp.dtype(head_dtype) == jnp.int8:
    q, scale = int8_head.quantize_head(embedding)
    return {HEAD_COPY: q, HEAD_SCALE: scale, BOUNDS: bound_rows(embedding, int8_head.dequantized(q, scale))}
  narrow = narrow_head(embedding, head_dtype)
  return {HEAD_COPY: narrow, BOUNDS: bound_rows(embedding, narrow.astype(jnp.float32).T)}


def bound_rows(embedding: jax.Array, wide: jax.Array) -> dict:
  """The per-token norms of the bound: embedding [V, D] float32 and the values of its narrow copy, wide [V, D]."""
  return {"rounding": jnp.linalg.norm(embedding - wide, axis=-1), "norm": jnp.linalg.norm(wide, axis=-1)}


def narrow_logits(tree: dict, x: jax.Array, decode_layout: bool) -> tuple[jax.Array, jax.Array]:
  """x [B, Q, D] through the narrow copy -> (approximate logits [B, Q, V] float32, n(x) [B, Q, D] float32)."""
  if HEAD_SCALE in tree:
    return int8_head.int8_logits(x, tree[HEAD_COPY], tree[HEAD_SCALE])
  narrow_x = x.astype(tree[HEAD_COPY].dtype).astype(x.dtype)  # what output_head multiplies the narrow head with
  return output_head(x, tree[HEAD_COPY], decode_layout), narrow_x


def upper_bounds(tree: dict, x: jax.Array, decode_layout: bool = True) -> jax.Array:
  """x [B, Q, D] final-normed hidden -> [B, Q, V] l~ + b: above every float32 logit x . w_v (before a softcap)."""
  approx, narrow_x = narrow_logits(tree, x, decode_layout)  # [B, Q, V], [B, Q, D]
  x_norm = jnp.linalg.norm(x, axis=-1, keepdims=True)  # [B, Q, 1]
  x_error = jnp.linalg.norm(x - narrow_x, axis=-1, keepdims=True)
  bounds = tree[BOUNDS]
  bound = x_norm * bounds["rounding"] + (x_error + x.shape[-1] * ACCUMULATION * x_norm) * bounds["norm"]
  return approx + bound


def head_logits(params, x: jax.Array, cap: float | None, decode_layout: bool = True, plan: HeadPlan = FIXED):
  """x [B, Q, D] final-normed hidden -> (logits [B, Q, V], exact ids [B, Q, K] or None).

  At the row counts of `plan.exact_at` (one row, and wherever the narrow head is no faster on this machine): the
  exact float32 head, ids None. Otherwise mixed logits (exact at the K ids, upper bounds elsewhere)."""
  tree = params["params"]
  if plan.exact_at(x.shape[0] * x.shape[1]):
    return exact_logits(params, x, cap, decode_layout, plan), None
  upper = upper_bounds(tree, x, decode_layout)
  ids = top_ids(upper, CANDIDATES)  # [B, Q, K]
  exact = jnp.einsum("bqd,bqkd->bqk", x, tree["embedder"][ids], preferred_element_type=jnp.float32)
  b, q = jnp.arange(x.shape[0])[:, None, None], jnp.arange(x.shape[1])[None, :, None]
  return softcap(upper.at[b, q, ids].set(exact), cap), ids


def top_ids(x: jax.Array, k: int, block: int = BLOCK) -> jax.Array:
  """Indices of the k largest entries of x [..., V] along the last axis: the values of `lax.top_k(x, k)`, in
  two levels. The k blocks of `block` entries with the largest maxima hold all of the k largest (an entry outside
  them is beaten by k block maxima, each an entry of its own), so a top-k of the V / block maxima and one of
  those blocks' k x block entries replace a top-k of V. On a 2-core CPU, 4 rows of 262k: 0.23 ms against 1.03.
  Among ties the set may differ from `lax.top_k`'s; the certificate holds for any set of exact tokens."""
  v = x.shape[-1]
  if v < k * block:  # too few blocks for two levels to pay
    return jax.lax.top_k(x, k)[1]
  pad = -v % block
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
  blocks = x.reshape(*x.shape[:-1], -1, block)  # [..., V / block, block]
  best = jax.lax.top_k(blocks.max(axis=-1), k)[1]  # [..., k] block ids
  entries = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(*x.shape[:-1], k * block)
  pos = jax.lax.top_k(entries, k)[1]  # [..., k] in the chosen blocks
  return jnp.take_along_axis(best, pos // block, axis=-1) * block + pos % block


def exact_logits(params, x: jax.Array, cap: float | None, decode_layout: bool = True,
                 plan: HeadPlan = FIXED) -> jax.Array:
  """The float32 head: x [B, Q, D] -> logits [B, Q, V]."""
  return softcap(output_head(x, params["params"]["embedder"], decode_layout, plan), cap)


def certified_requests(chosen: jax.Array, ids: jax.Array, row_ok: jax.Array) -> jax.Array:
  """[B] bool: every row of the request that fed chose one of its exact tokens. chosen, row_ok: [B, Q]; ids
  [B, Q, K]."""
  return jnp.all(~row_ok | jnp.any(ids == chosen[..., None], axis=-1), axis=-1)
