"""Attention whose mask is computed, tile by tile, from the thread metadata of the one visibility rule.

  visible(q, k) = valid[k] and order[k] <= horizon[q, owner[k]]      (pasta_jax.visibility)

`visibility.ThreadMask` carries that metadata (per query row: a horizon per thread; per key: owner, write order, valid
bit). `attention` takes it, never a [Q, S] mask:
  - "xla": the mask from `visibility.visible`, then `gemma.attend`'s math: the reference and the CPU default;
  - "pallas-tpu": a Pallas kernel in the TPU (Mosaic) style: grid (batch, KV head, query block, key block),
    online softmax in VMEM scratch over the key blocks;
  - "pallas-gpu": a Pallas kernel in the GPU (Triton) style, flash decoding: grid (batch, KV head, row block,
    split of the pool), a loop over the split's key blocks inside, the splits merged in XLA
    (`thread_attention_gpu.py`).
Both kernels compute each tile's mask from the metadata in the kernel, skip a tile in which no key is visible
to any query row of the tile (from per-block summaries: the smallest write order per thread among a key
block's valid keys, the largest horizon per thread among a query block's rows), and handle grouped-query
heads, Gemma's attention soft cap and sliding windows. `interpret=True` runs them on any backend (the tests
run them on CPU: TPU interpret mode, and the generic interpreter for the GPU kernel).

Gradients: the kernels' backward pass is the XLA attention's (a `custom_vjp` that recomputes through "xla"),
so gradients equal XLA's exactly; the backward still builds the [Q, S] mask (a Pallas backward is open work).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pasta_jax.model import thread_attention_gpu
from pasta_jax.model.thread_tiles import NEG, block_summaries
from pasta_jax.visibility import ThreadMask

__all__ = ["AttentionSpec", "attention", "block_summaries", "resolve", "xla_attention"]

IMPLEMENTATIONS = ("xla", "pallas-tpu", "pallas-gpu")
CHOICES = ("xla", "pallas", "pallas-tpu", "pallas-gpu")  # what a model's `attention` switch takes


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static settings of one attention call."""

  scale: float
  softcap: float | None = None
  window: int | None = None  # sliding window: a key is seen only while q_pos - kv_pos < window
  implementation: str = "xla"
  block_q: int = 8  # query rows per tile (each brings its G grouped heads)
  block_k: int = 128  # keys per tile
  splits: int | None = None  # GPU kernel: programs the pool's key blocks are dealt to (None: fill the device)
  interpret: bool = False

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}")


def resolve(choice: str) -> tuple[str, bool]:
  """A model's `attention` switch -> (implementation, interpret). "pallas" picks the device's kernel: the
  TPU one on a TPU, the GPU one on a GPU, and on CPU the TPU one in interpret mode (correct, slow: tests)."""
  if choice not in CHOICES:
    raise ValueError(f"attention must be one of {CHOICES}, got {choice!r}")
  backend = jax.default_backend()
  on_gpu = backend in ("gpu", "cuda", "rocm")
  if choice == "pallas":
    choice = "pallas-gpu" if on_gpu else "pallas-tpu"
  interpret = (choice == "pallas-tpu" and backend != "tpu") or (choice == "pallas-gpu" and not on_gpu)
  return choice, interpret


def attention(q, k, v, mask: ThreadMask, q_pos, kv_pos, spec: AttentionSpec):
  """q: [B, Q, H, hd]; k, v: [B, S, K, hd]; q_pos: [B, Q]; kv_pos: [B, S]. Returns [B, Q, H, hd]; a query row
  that sees no key returns zeros."""
  if spec.implementation == "xla":
    return xla_attention(q, k, v, mask, q_pos, kv_pos, spec)
  return _kernel_attention(q, k, v, mask, q_pos, kv_pos, spec)


def xla_attention(q, k, v, mask: ThreadMask, q_pos, kv_pos, spec: AttentionSpec):
  """The reference: the dense mask from the one rule, then masked grouped-query attention."""
  dense = mask.dense()
  if spec.window is not None:
    dense = dense & (q_pos[:, :, None] - kv_pos[:, None, :] < spec.window)
  b, nq, h, hd = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(b, nq, kv_heads, h // kv_heads, hd)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * spec.scale
  if spec.softcap is not None:
    scores = jnp.tanh(scores / spec.softcap) * spec.softcap
  seen = dense[:, None, None, :, :]
  probs = jax.nn.softmax(jnp.where(seen, scores, jnp.finfo(jnp.float32).min), axis=-1)
  probs = jnp.where(seen, probs, 0.0).astype(v.dtype)
  return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, nq, h, hd)


# --- the kernels ---------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kernel_attention(q, k, v, mask, q_pos, kv_pos, spec):
  return _kernel_forward(q, k, v, mask, q_pos, kv_pos, spec)


def _fwd(q, k, v, mask, q_pos, kv_pos, spec):
  return _kernel_forward(q, k, v, mask, q_pos, kv_pos, spec), (q, k, v, mask, q_pos, kv_pos)


def _bwd(spec, residuals, grad):
  q, k, v, mask, q_pos, kv_pos = residuals
  _, vjp = jax.vjp(lambda q_, k_, v_: xla_attention(q_, k_, v_, mask, q_pos, kv_pos, spec), q, k, v)
  zeros = jax.tree.map(lambda x: None if x.dtype == bool or jnp.issubdtype(x.dtype, jnp.integer) else
                       jnp.zeros_like(x), (mask, q_pos, kv_pos))
  return (*vjp(grad), *zeros)


_kernel_attention.defvjp(_fwd, _bwd)


def tile_mask(horizon, owner, order, valid, q_pos, kv_pos, window):
  """[bq, bk] bool for one tile: horizon [bq, U], owner/order/valid/kv_pos [bk], q_pos [bq]. The horizon of
  each key's owner is picked thread by thread (no gather: a select per thread, as a TPU vector unit wants)."""
  def pick(u, limit):
    return jnp.where(owner[None, :] == u, jax.lax.dynamic_slice_in_dim(horizon, u, 1, axis=1), limit)

  limit = jax.lax.fori_loop(0, horizon.shape[1], pick, jnp.full((horizon.shape[0], owner.shape[0]), -1, jnp.int32))
  seen = valid[None, :] & (order[None, :] <= limit)
  if window is not None:
    seen = seen & (q_pos[:, None] - kv_pos[None, :] < window)
  return seen


def online_update(q, k, v, seen, m, denom, acc, spec: AttentionSpec):
  """One key tile of the online softmax. q: [bq, G, hd]; k, v: [bk, hd]; seen: [bq, bk]; m (running max),
  denom (running sum of exponentials): [bq*G, 1]; acc: [bq*G, hd] (float32). Returns the new (m, denom, acc)."""
  bq, g, hd = q.shape
  s = jnp.dot(q.reshape(bq * g, hd).astype(jnp.float32), k.astype(jnp.float32).T) * spec.scale
  if spec.softcap is not None:
    s = jnp.tanh(s / spec.softcap) * spec.softcap
  rows_seen = jnp.repeat(seen, g, axis=0)  # row r = query r // G, head r % G
  s = jnp.where(rows_seen, s, NEG)
  m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
  p = jnp.where(rows_seen, jnp.exp(s - m_new), 0.0)
  alpha = jnp.exp(m - m_new)
  return m_new, alpha * denom + p.sum(axis=1, keepdims=True), alpha * acc + jnp.dot(p, v.astype(jnp.float32))


def finish(denom, acc, shape, dtype):
  """acc / denom, zeros for a row that saw no key."""
  return jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0).reshape(shape).astype(dtype)


def _tpu_kernel(q_ref, k_ref, v_ref, hor_ref, owner_ref, order_ref, valid_ref, qpos_ref, kpos_ref, qmax_ref,
                kmin_ref, o_ref, m_sc, l_sc, acc_sc, *, spec: AttentionSpec):
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  @pl.when(jnp.any(kmin_ref[0] <= qmax_ref[0]))  # a tile no query row can see anything of is skipped
  def _():
    seen = tile_mask(hor_ref[...], owner_ref[0], order_ref[0], valid_ref[0] > 0, qpos_ref[:, 0], kpos_ref[0],
                     spec.window)
    m, denom, acc = online_update(q_ref[...], k_ref[...], v_ref[...], seen, m_sc[...], l_sc[...], acc_sc[...], spec)
    m_sc[...], l_sc[...], acc_sc[...] = m, denom, acc

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    o_ref[...] = finish(l_sc[...], acc_sc[...], o_ref.shape, o_ref.dtype)


def _kernel_forward(q, k, v, mask: ThreadMask, q_pos, kv_pos, spec: AttentionSpec):
  if spec.implementation == "pallas-gpu":
    return thread_attention_gpu.flash_decode(q, k, v, mask, q_pos, kv_pos, scale=spec.scale, softcap=spec.softcap,
                                             window=spec.window, block_q=spec.block_q, block_k=spec.block_k,
                                             splits=spec.splits, interpret=spec.interpret)
  return _tpu_forward(q, k, v, mask, q_pos, kv_pos, spec)


def _tpu_forward(q, k, v, mask: ThreadMask, q_pos, kv_pos, spec: AttentionSpec):
  b, nq, h, hd = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  g = h // kv_heads
  bq, bk = math.gcd(spec.block_q, nq), math.gcd(spec.block_k, s)  # the largest blocks that tile the call
  q_blocks, k_blocks = nq // bq, s // bk
  q_max, k_min = block_summaries(mask, q_blocks, k_blocks)
  u = mask.horizon.shape[-1]
  keys = lambda x: x.astype(jnp.int32)[:, None, :]  # noqa: E731  [B, 1, S]: 2-D blocks per batch row
  args = (q, k, v, mask.horizon, keys(mask.owner), keys(mask.order), keys(mask.valid),
          q_pos.astype(jnp.int32)[..., None], keys(kv_pos), q_max, k_min)
  out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
  specs = [
      pl.BlockSpec((None, bq, g, hd), lambda bi, hi, i, j: (bi, i, hi, 0)),
      pl.BlockSpec((None, bk, None, hd), lambda bi, hi, i, j: (bi, j, hi, 0)),
      pl.BlockSpec((None, bk, None, hd), lambda bi, hi, i, j: (bi, j, hi, 0)),
      pl.BlockSpec((None, bq, u), lambda bi, hi, i, j: (bi, i, 0)),
      *[pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, j))] * 3,
      pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
      pl.BlockSpec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, j)),
      pl.BlockSpec((None, 1, u), lambda bi, hi, i, j: (bi, i, 0)),
      pl.BlockSpec((None, 1, u), lambda bi, hi, i, j: (bi, j, 0)),
  ]
  return pl.pallas_call(
      functools.partial(_tpu_kernel, spec=spec), out_shape=out_shape, grid=(b, kv_heads, q_blocks, k_blocks),
      in_specs=specs, out_specs=pl.BlockSpec((None, bq, g, hd), lambda bi, hi, i, j: (bi, i, hi, 0)),
      scratch_shapes=[pltpu.VMEM((bq * g, 1), jnp.float32), pltpu.VMEM((bq * g, 1), jnp.float32),
                      pltpu.VMEM((bq * g, hd), jnp.float32)],
      interpret=pltpu.InterpretParams() if spec.interpret else False)(*args)
