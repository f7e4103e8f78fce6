"""The GPU (Triton-style) kernel of thread-metadata attention: flash decoding over the interleaved pool.

A decode call has few query rows (lanes x grouped heads) and a long pool, so one program per query block would
leave all but one of an H100's 132 multiprocessors idle. The pool's key blocks are dealt to `splits` programs
round-robin (split p takes blocks p, p + P, p + 2P, ...: the visible blocks, often the pool's front where the
prompt and main's prefix live, spread over every program instead of piling into the first few);
program (batch, KV head, row block, split) runs the online softmax over its blocks, skips every key block that no
row of its block can see (`thread_tiles.block_summaries`: the same test as the TPU kernel), and writes its partial
(running max, sum of exponentials, weighted values); XLA then merges the splits. A training call (many rows) gets
one split and many row blocks instead.

Triton wants every value's shape a power of two and the tensor cores at least 16 rows, so the rows are (query,
grouped head) pairs padded to a power of two >= 16, the threads are padded to a power of two, and a tile's mask is
built from per-thread columns of the rows' horizons, one select per thread (no gather). Float32 inputs multiply at
full precision (Triton's default for them is TF32); bfloat16 inputs accumulate in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pasta_jax.model.thread_tiles import NEG, block_summaries
from pasta_jax.visibility import HIDDEN, ThreadMask

MIN_ROWS = 16  # the smallest M of a tensor-core product
TARGET_PROGRAMS = 264  # about two programs per multiprocessor of an H100 (132)
MAX_BLOCK_ROWS = 64


def pow2(n: int, least: int = 1) -> int:
  """The smallest power of two >= max(n, least)."""
  return max(least, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The static cut of one call. rows: padded (query, head) rows; threads: padded thread count."""

  rows: int
  block_rows: int
  threads: int
  block_k: int
  k_blocks: int
  splits: int

  @property
  def per_split(self) -> int:
    return -(-self.k_blocks // self.splits)

  @classmethod
  def plan(cls, *, rows: int, group: int, threads: int, slots: int, programs: int, block_q: int, block_k: int,
           splits: int | None) -> Tiling:
    """rows: queries x grouped heads; block_q: queries per row block (each brings its `group` heads);
    programs: batch x KV heads (the grid's outer extent)."""
    if block_k & (block_k - 1) or slots % block_k:
      raise ValueError(f"the GPU kernel needs a power-of-two block_k that divides the pool ({slots} slots), "
                       f"got {block_k}")
    padded = pow2(rows, MIN_ROWS)
    block_rows = min(padded, MAX_BLOCK_ROWS, pow2(block_q * group, MIN_ROWS))
    k_blocks = slots // block_k
    if splits is None:
      splits = max(1, min(k_blocks, TARGET_PROGRAMS // max(1, programs * (padded // block_rows))))
    return cls(padded, block_rows, pow2(threads), block_k, k_blocks, max(1, min(splits, k_blocks)))


def flash_decode(q, k, v, mask: ThreadMask, q_pos, kv_pos, *, scale: float, softcap: float | None,
                 window: int | None, block_q: int, block_k: int, splits: int | None, interpret: bool):
  """q: [B, Q, H, hd]; k, v: [B, S, K, hd]; q_pos: [B, Q]; kv_pos: [B, S]. Returns [B, Q, H, hd] (zeros for a
  row that sees no key)."""
  b, nq, h, hd = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  g = h // kv_heads
  tiling = Tiling.plan(rows=nq * g, group=g, threads=mask.horizon.shape[-1], slots=s, programs=b * kv_heads,
                       block_q=block_q, block_k=block_k, splits=splits)
  rows, horizon, row_pos = _rows(q, mask.horizon, q_pos, g, tiling)
  padded_mask = dataclasses.replace(mask, horizon=horizon)
  q_max, k_min = block_summaries(padded_mask, tiling.rows // tiling.block_rows, tiling.k_blocks)
  keys = lambda x: x.astype(jnp.int32)  # noqa: E731
  m, denom, acc = _partials(rows, k, v, horizon, row_pos, keys(mask.owner), keys(mask.order), keys(mask.valid),
                            keys(kv_pos), q_max, k_min, tiling=tiling, scale=scale, softcap=softcap, window=window,
                            interpret=interpret)
  out = _merge(m, denom, acc)[:, :, : nq * g]  # [B, K, Q*G, hd]
  return out.reshape(b, kv_heads, nq, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, nq, h, hd).astype(q.dtype)


def _rows(q, horizon, q_pos, g: int, tiling: Tiling):
  """([B, K, R, hd] query rows, [B, R, U'] their horizons, [B, R] their positions): row r is query r // G,
  grouped head r % G; padded rows see nothing, padded threads own nothing."""
  b, nq, h, hd = q.shape
  pad = tiling.rows - nq * g
  rows = q.reshape(b, nq, h // g, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, h // g, nq * g, hd)
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad), (0, 0)))
  horizon = jnp.repeat(horizon.astype(jnp.int32), g, axis=1)
  horizon = jnp.pad(horizon, ((0, 0), (0, pad), (0, tiling.threads - horizon.shape[-1])), constant_values=HIDDEN)
  row_pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1), ((0, 0), (0, pad)))
  return rows, horizon, row_pos


def _merge(m, denom, acc):
  """Split partials ([B, K, P, R], [B, K, P, R], [B, K, P, R, hd]) -> [B, K, R, hd]."""
  top = m.max(axis=2, keepdims=True)
  weight = jnp.exp(m - top)  # a split that saw nothing has denom 0 and acc 0, whatever its weight
  total = (weight * denom).sum(axis=2)[..., None]
  out = (weight[..., None] * acc).sum(axis=2)
  return jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)


def _partials(rows, k, v, horizon, row_pos, owner, order, valid, kv_pos, q_max, k_min, *, tiling: Tiling,
              scale, softcap, window, interpret):
  b, kv_heads, r, hd = rows.shape
  s = k.shape[1]
  br, u, p = tiling.block_rows, tiling.threads, tiling.splits
  grid = (b, kv_heads, r // br, p)
  in_specs = [
      pl.BlockSpec((None, None, br, hd), lambda bi, hi, i, sp: (bi, hi, i, 0)),
      pl.BlockSpec((None, s, None, hd), lambda bi, hi, i, sp: (bi, 0, hi, 0)),
      pl.BlockSpec((None, s, None, hd), lambda bi, hi, i, sp: (bi, 0, hi, 0)),
      pl.BlockSpec((None, br, u), lambda bi, hi, i, sp: (bi, i, 0)),
      pl.BlockSpec((None, br), lambda bi, hi, i, sp: (bi, i)),
      *[pl.BlockSpec((None, s), lambda bi, hi, i, sp: (bi, 0))] * 4,
      pl.BlockSpec((None, 1, u), lambda bi, hi, i, sp: (bi, i, 0)),
      pl.BlockSpec((None, tiling.k_blocks, u), lambda bi, hi, i, sp: (bi, 0, 0)),
  ]
  row_spec = pl.BlockSpec((None, None, None, br), lambda bi, hi, i, sp: (bi, hi, sp, i))
  out_specs = [row_spec, row_spec, pl.BlockSpec((None, None, None, br, hd), lambda bi, hi, i, sp: (bi, hi, sp, i, 0))]
  out_shape = [jax.ShapeDtypeStruct((b, kv_heads, p, r), jnp.float32)] * 2 + [
      jax.ShapeDtypeStruct((b, kv_heads, p, r, hd), jnp.float32)]
  kernel = functools.partial(_kernel, tiling=tiling, scale=scale, softcap=softcap, window=window)
  params = None if interpret else _compiler_params()
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        compiler_params=params, interpret=interpret)(
      rows, k, v, horizon, row_pos, owner, order, valid, kv_pos, q_max, k_min)


def _compiler_params():
  return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _kernel(q_ref, k_ref, v_ref, hor_ref, qpos_ref, owner_ref, order_ref, valid_ref, kpos_ref, qmax_ref, kmin_ref,
            m_ref, l_ref, acc_ref, *, tiling: Tiling, scale, softcap, window):
  q = q_ref[...]  # [br, hd]
  br, hd = q.shape
  bk = tiling.block_k
  columns = [hor_ref[:, pl.ds(u, 1)] for u in range(tiling.threads)]  # [br, 1] each: the horizon per thread
  q_pos = qpos_ref[...]
  q_max = qmax_ref[...]  # [1, U]
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  split = pl.program_id(3)

  def update(j, carry):
    m, denom, acc = carry
    keys = pl.ds(j * bk, bk)
    owner = owner_ref[keys][None, :]
    limit = jnp.full((br, bk), HIDDEN, jnp.int32)
    for u, column in enumerate(columns):
      limit = jnp.where(owner == u, column, limit)
    seen = (valid_ref[keys][None, :] > 0) & (order_ref[keys][None, :] <= limit)
    if window is not None:
      seen = seen & (q_pos[:, None] - kpos_ref[keys][None, :] < window)
    scores = jax.lax.dot_general(q, k_ref[keys, :], (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * scale
    if softcap is not None:
      scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(seen, scores, NEG)
    m_new = jnp.maximum(m, scores.max(axis=1))
    probs = jnp.where(seen, jnp.exp(scores - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    values = jax.lax.dot_general(probs.astype(v_ref.dtype), v_ref[keys, :], (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
    return m_new, alpha * denom + probs.sum(axis=1), alpha[:, None] * acc + values

  def body(step, carry):
    j = split + step * tiling.splits
    block = jnp.minimum(j, tiling.k_blocks - 1)
    live = (j < tiling.k_blocks) & (jnp.max(jnp.where(kmin_ref[pl.ds(block, 1), :] <= q_max, 1, 0)) > 0)
    return jax.lax.cond(live, functools.partial(update, block), lambda c: c, carry)

  init = (jnp.full((br,), NEG, jnp.float32), jnp.zeros((br,), jnp.float32), jnp.zeros((br, hd), jnp.float32))
  m, denom, acc = jax.lax.fori_loop(0, tiling.per_split, body, init)
  m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc
