"""Gemma 1/2/3 text decoder in Flax.

One code path serves every use: training (full sequences with the PASTA mask), prefill, single
decode steps over an interleaved KV pool, APAR and token trees. The caller always gives explicit
positions and a boolean mask; the model never assumes causality or contiguity.

Parameter tree (the loaders in `weights.py` write exactly this):
  embedder                          [V, D]   (tied: also the output projection)
  layer_{i}/pre_attn_norm/scale     [D]
  layer_{i}/attn/{q}                [D, H, hd]
  layer_{i}/attn/{k,v}              [D, K, hd]
  layer_{i}/attn/o                  [H, hd, D]
  layer_{i}/attn/{q_norm,k_norm}/scale [hd]        (Gemma 3)
  layer_{i}/post_attn_norm/scale    [D]            (Gemma 2, 3)
  layer_{i}/pre_ffw_norm/scale      [D]
  layer_{i}/mlp/{gate,up}           [D, F]
  layer_{i}/mlp/down                [F, D]
  layer_{i}/post_ffw_norm/scale     [D]            (Gemma 2, 3)
  final_norm/scale                  [D]
Norm scales are stored as in Hugging Face checkpoints: the model multiplies by (1 + scale).

Decode layout (`Gemma(decode_layout=True)`, params from `to_decode_layout`): every projection above
is stored transposed, [*out, *in], under its name + "_t" (so a tree of the other layout fails
loudly), and multiplied weight-major. Same function, other float summation order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from pasta_jax.model import kv_rows, thread_attention
from pasta_jax.model.config import GemmaConfig
from pasta_jax.model.head_plan import FIXED as FIXED_HEAD_PLAN
from pasta_jax.model.head_plan import HeadPlan
from pasta_jax.model.lora import A_SUFFIX, B_SUFFIX, ROWS, AdapterConfig
from pasta_jax.model.output import ModelOutput
from pasta_jax.visibility import ThreadMask, visible

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
  """K/V for every layer over S pool slots: [layers, B, S, kv_heads, head_dim]."""

  k: Array
  v: Array

  @classmethod
  def zeros(cls, config: GemmaConfig, batch: int, slots: int, dtype=jnp.float32) -> KVPool:
    shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def num_slots(self) -> int:
    return self.k.shape[2]

  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes


@dataclasses.dataclass(frozen=True)
class RowSelect:
  """Query rows that go on past an early layer (ProPD's early pruning): after `layer` layers, `choose(x, tokens)`
  (x [B, Q, D] the residual stream, tokens [B, Q]) returns (rows [B, M] int32, ok [B, M] bool), and only those M
  rows (a static count) run the deeper layers and the output head; a row with ok False writes no K/V there.
  The model's logits and head_input then come back scattered to [B, Q] (zeros at rows cut), with `kept` [B, Q]."""

  layer: int
  keep: int  # M
  choose: Callable


def select_rows(select: RowSelect, x, tokens, positions, mask, slots, num_slots: int):
  """Gathers the rows `select` keeps: (x, positions, mask, slots) of M rows, and (rows, ok) [B, M]."""
  rows, ok = select.choose(x, tokens)
  take = lambda a: jnp.take_along_axis(a, rows.reshape(rows.shape + (1,) * (a.ndim - 2)), axis=1)
  if isinstance(mask, ThreadMask):
    mask = dataclasses.replace(mask, horizon=take(mask.horizon))
  else:
    mask = take(mask)
  return take(x), take(positions), mask, jnp.where(ok, take(slots), num_slots), rows, ok


def scatter_rows(values, rows, ok, num_q: int):
  """values [B, M, X] of the kept rows -> [B, Q, X], zeros elsewhere."""
  out = jnp.zeros((values.shape[0], num_q) + values.shape[2:], values.dtype)
  return out.at[jnp.arange(values.shape[0])[:, None], jnp.where(ok, rows, num_q)].set(values, mode="drop")


def scatter_kept(out: ModelOutput, rows, ok, num_q: int) -> ModelOutput:
  """A pruned call's outputs of its M kept rows back at their Q rows (zeros at the rows cut), and `kept` [B, Q].
  The K/V are already laid out per row (`kv_rows.stack_layers`), or written at their slots."""
  back = lambda values: None if values is None else scatter_rows(values, rows, ok, num_q)
  kept = scatter_rows(ok[..., None], rows, ok, num_q)[..., 0]
  return dataclasses.replace(out, logits=back(out.logits), head_input=back(out.head_input), kept=kept)


class RMSNorm(nn.Module):
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


def apply_rope(x: Array, positions: Array, base: float, scale: float) -> Array:
  """Rotary embedding, half-split convention (as HF Gemma). x: [B, Q, N, hd], positions: [B, Q]."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (base ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
  angles = (positions.astype(jnp.float32) / scale)[..., None] * inv_freq  # [B, Q, half]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def softcap(x: Array, cap: float | None) -> Array:
  return x if cap is None else jnp.tanh(x / cap) * cap


# Projections: name -> number of input axes, for the training layout [*in, *out].
PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
DECODE_SUFFIX = "_t"


def to_decode_layout(params):
  """The same weights in the decode layout: each projection [*in, *out] -> [*out, *in] named name_t."""
  def convert(tree):
    out = {}
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = convert(value)
      elif name in PROJECTIONS:
        n_in = PROJECTIONS[name]
        axes = tuple(range(n_in, value.ndim)) + tuple(range(n_in))
        out[name + DECODE_SUFFIX] = jnp.transpose(value, axes)
      else:
        out[name] = value
    return out
  return convert(params)


def projection(module: nn.Module, name: str, in_shape: tuple, out_shape: tuple, dtype, decode_layout: bool):
  """A projection weight as `module`'s param, in the training or the decode layout."""
  init = nn.initializers.normal(0.02)
  if decode_layout:
    return module.param(name + DECODE_SUFFIX, init, out_shape + in_shape).astype(dtype)
  return module.param(name, init, in_shape + out_shape).astype(dtype)


def project(x: Array, w: Array, in_dims: str, out_dims: str, decode_layout: bool, **kw) -> Array:
  """x [b, q, *in] times a projection weight -> [b, q, *out] (dims named by single letters).

  The decode layout multiplies weight-major ([*out, *in] x [*in, b*q]): XLA:CPU then streams the
  weight once for all rows, where the token-major form costs 1.4-2x one row's time from two rows on
  (`python -m bench.step_cost`), which would eat the parallel lanes' gain.
  """
  if decode_layout:
    weight_major = jnp.einsum(f"bq{in_dims},{out_dims}{in_dims}->{out_dims}bq", x, w, **kw)
    return jnp.einsum(f"{out_dims}bq->bq{out_dims}", weight_major)
  return jnp.einsum(f"bq{in_dims},{in_dims}{out_dims}->bq{out_dims}", x, w, **kw)


HEAD_COPY = "unembed"  # decode layout with a narrow head: the tied head [D, V] in `Gemma.head_dtype` (`narrow_head`)


def narrow_head(embedding: Array, dtype) -> Array:
  """The tied head's narrow copy: embedding [V, D] -> [D, V] in `dtype`. Stored [in, out] because that is the layout
  XLA:CPU's small-row matmul (YNNPACK) reads: from a [V, D] copy, every call of a compiled decode loop first
  transposed the whole head (335 MB for the 270M's bfloat16 copy, ~0.2 s on 2 CPU cores), hoisted out of the loop."""
  return embedding.T.astype(dtype)


def narrow_head_product(x: Array, unembed: Array) -> Array:
  """x [B, Q, D] times a narrow head unembed [D, V] (`narrow_head`): x rounded to the head's dtype, float32
  accumulation, token-major, one row padded to two (on XLA:CPU YNNPACK then reads half the bytes for any row count,
  where a single bfloat16 row would take a slow gemv; `python -m bench.head_precision`)."""
  rows = x.shape[1]
  narrow = x.astype(unembed.dtype)
  if x.shape[0] * rows == 1:
    narrow = jnp.concatenate([narrow, narrow], axis=1)
  return jnp.einsum("bqd,dv->bqv", narrow, unembed, preferred_element_type=jnp.float32)[:, :rows]


def output_head(x: Array, unembed: Array, decode_layout: bool, plan: HeadPlan = FIXED_HEAD_PLAN) -> Array:
  """x [B, Q, D] times the tied head unembed [V, D] -> float32 logits [B, Q, V].

  An unembed narrower than x (`Gemma.head_dtype`: [D, V], `narrow_head`) multiplies as `narrow_head_product`. In
  full precision the decode layout multiplies weight-major, or token-major at the row counts (B * Q) of
  `plan.token_major`: which is faster depends on the machine (model/head_plan.py)."""
  if jnp.issubdtype(unembed.dtype, jnp.integer):
    raise ValueError("an int8 head multiplies only inside the certified head (decode/certified_head.py), which "
                     "holds its scales: call the model with skip_head")
  if jnp.dtype(unembed.dtype).itemsize < jnp.dtype(x.dtype).itemsize:
    return narrow_head_product(x, unembed)
  if decode_layout and x.shape[0] * x.shape[1] not in plan.token_major:
    return project(x, unembed, "d", "v", True, preferred_element_type=jnp.float32)
  return jnp.einsum("bqd,vd->bqv", x, unembed, preferred_element_type=jnp.float32)


def adapted_projection(module: nn.Module, name: str, x: Array, in_shape: tuple, out_shape: tuple, in_dims: str,
                       out_dims: str, decode_layout: bool, adapter: AdapterConfig | None) -> Array:
  """x times the projection `name`, plus the LoRA path (alpha / r) (x A) B when `adapter` targets it."""
  y = project(x, projection(module, name, in_shape, out_shape, x.dtype, decode_layout), in_dims, out_dims,
              decode_layout)
  if adapter is None or name not in adapter.targets:
    return y
  if decode_layout:
    raise ValueError("fold the adapter into the weights (lora.fold) before decoding in the decode layout")
  a = module.param(name + A_SUFFIX, nn.initializers.zeros_init(), in_shape + (adapter.rank,)).astype(x.dtype)
  b = module.param(name + B_SUFFIX, nn.initializers.zeros_init(), (adapter.rank,) + out_shape).astype(x.dtype)
  low = project(x, a, in_dims, "r", False)
  return y + adapter.scale * project(low, b, "r", out_dims, False)


def write_slots(pool: Array, layer: int, new: Array, slots: Array) -> Array:
  """Scatter new rows [B, Q, K, hd] into pool [layers, B, S, K, hd] at (layer, slots [B, Q]).

  Writes into the stacked pool (not a per-layer copy) so XLA updates it in place inside the
  decode loop. A slot index >= S (how callers mark inactive rows) is dropped: padding never
  clobbers a live slot.
  """
  batch_idx = jnp.arange(new.shape[0])[:, None]
  return pool.at[layer, batch_idx, slots].set(new.astype(pool.dtype), mode="drop")


def attend(q: Array, k: Array, v: Array, mask: Array, scale: float, cap: float | None) -> Array:
  """Masked grouped-query attention.

  q: [B, Q, H, hd]; k, v: [B, S, K, hd]; mask: [B, Q, S] bool. Returns [B, Q, H, hd].
  A query row with no visible key (an inactive lane) returns zeros, never NaN.
  """
  return attend_segments(q, ((k, v),), mask, scale, cap)


def attend_segments(q: Array, segments, mask: Array, scale: float, cap: float | None) -> Array:
  """`attend` over keys held in several arrays: segments ((k [B, S_i, K, hd], v), ...), mask [B, Q, sum S_i]
  over their concatenation. One softmax over all of them; no key array is concatenated (the pool stays put)."""
  b, nq, h, hd = q.shape
  kv_heads = segments[0][0].shape[2]
  q = q.reshape(b, nq, kv_heads, h // kv_heads, hd)
  scores = [jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) for k, _ in segments]
  scores = softcap(jnp.concatenate(scores, axis=-1) * scale, cap)
  visible = mask[:, None, None, :, :]
  scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  out, start = 0, 0
  for k, v in segments:
    part = probs[..., start:start + k.shape[1]].astype(v.dtype)
    out = out + jnp.einsum("bkgqs,bskd->bqkgd", part, v)
    start += k.shape[1]
  return out.reshape(b, nq, h, hd)


class Attention(nn.Module):
  config: GemmaConfig
  kind: str  # "global" | "local"
  layer: int
  decode_layout: bool = False
  adapter: AdapterConfig | None = None
  attention: str = "xla"  # "xla" (a dense mask) or a kernel over the thread metadata (thread_attention.CHOICES)
  # The pool is read only; the layer returns its new rows' K/V in its place (model/kv_rows.py). With "xla" the
  # mask is then [B, Q, S + Q] (`kv_rows.extend_mask`) and kv_positions [B, S + Q].
  defer_writes: bool = False

  @nn.compact
  def __call__(self, x, positions, mask, kv_positions, pool_k, pool_v, slots):
    """Returns (output [B, Q, D], the pool's K and V updated), or with defer_writes (output, k, v [B, Q, K, hd])."""
    cfg = self.config
    layout, ad = self.decode_layout, self.adapter
    model, heads, kv_heads = (cfg.embed_dim,), (cfg.num_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)
    q = adapted_projection(self, "q", x, model, heads, "d", "hk", layout, ad)
    k = adapted_projection(self, "k", x, model, kv_heads, "d", "hk", layout, ad)
    v = adapted_projection(self, "v", x, model, kv_heads, "d", "hk", layout, ad)
    if cfg.use_qk_norm:
      q = RMSNorm(cfg.rms_norm_eps, name="q_norm")(q)
      k = RMSNorm(cfg.rms_norm_eps, name="k_norm")(k)
    is_local = self.kind == "local"
    base = cfg.rope_base_local if is_local else cfg.rope_base_global
    scale = 1.0 if is_local else cfg.rope_scale_global
    q = apply_rope(q, positions, base, scale)
    k = apply_rope(k, positions, base, scale)
    project_out = lambda out: adapted_projection(self, "o", out, heads, model, "hk", "d", layout, ad)
    if self.defer_writes and not isinstance(mask, ThreadMask):  # the pool's slots and the new rows, unwritten
      if is_local:
        mask = mask & (positions[:, :, None] - kv_positions[:, None, :] < cfg.sliding_window)
      segments = ((pool_k[self.layer], pool_v[self.layer]), (k, v))
      out = attend_segments(q, segments, mask, cfg.query_pre_attn_scalar**-0.5, cfg.attn_logit_softcap)
      return project_out(out), k, v
    if pool_k is None:  # full sequence: the new rows are the whole key set
      keys, values = k, v
    elif self.defer_writes:  # under a kernel, which reads one key array: a copy of this layer, written
      keys = write_slots(pool_k[self.layer][None], 0, k, slots)[0]
      values = write_slots(pool_v[self.layer][None], 0, v, slots)[0]
      pool_k, pool_v = k, v  # the rows go back (kv_rows)
    else:
      pool_k = write_slots(pool_k, self.layer, k, slots)
      pool_v = write_slots(pool_v, self.layer, v, slots)
      keys, values = pool_k[self.layer], pool_v[self.layer]
    if isinstance(mask, ThreadMask):  # a kernel computes the mask tile by tile from the metadata
      implementation, interpret = thread_attention.resolve(self.attention)
      spec = thread_attention.AttentionSpec(
          scale=cfg.query_pre_attn_scalar**-0.5, softcap=cfg.attn_logit_softcap,
          window=cfg.sliding_window if is_local else None, implementation=implementation, interpret=interpret)
      out = thread_attention.attention(q, keys, values, mask, positions, kv_positions, spec)
      return project_out(out), pool_k, pool_v
    if is_local:
      distance = positions[:, :, None] - kv_positions[:, None, :]
      mask = mask & (distance < cfg.sliding_window)
    out = attend(q, keys, values, mask, cfg.query_pre_attn_scalar**-0.5, cfg.attn_logit_softcap)
    return project_out(out), pool_k, pool_v


class MLP(nn.Module):
  config: GemmaConfig
  decode_layout: bool = False
  adapter: AdapterConfig | None = None

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    layout, ad = self.decode_layout, self.adapter
    model, hidden = (cfg.embed_dim,), (cfg.hidden_dim,)
    gate = adapted_projection(self, "gate", x, model, hidden, "d", "f", layout, ad)
    up = adapted_projection(self, "up", x, model, hidden, "d", "f", layout, ad)
    return adapted_projection(self, "down", jax.nn.gelu(gate, approximate=True) * up, hidden, model, "f", "d",
                              layout, ad)


class Block(nn.Module):
  config: GemmaConfig
  kind: str
  layer: int
  decode_layout: bool = False
  adapter: AdapterConfig | None = None
  attention: str = "xla"
  defer_writes: bool = False  # Attention's: the pool read only, the new rows' K/V returned in its place

  @nn.compact
  def __call__(self, x, positions, mask, kv_positions, pool_k, pool_v, slots):
    cfg = self.config
    eps = cfg.rms_norm_eps
    h = RMSNorm(eps, name="pre_attn_norm")(x)
    h, pool_k, pool_v = Attention(cfg, self.kind, self.layer, self.decode_layout, self.adapter, self.attention,
                                  self.defer_writes, name="attn")(
        h, positions, mask, kv_positions, pool_k, pool_v, slots)
    if cfg.use_post_attn_norm:
      h = RMSNorm(eps, name="post_attn_norm")(h)
    x = x + h
    h = MLP(cfg, self.decode_layout, self.adapter, name="mlp")(RMSNorm(eps, name="pre_ffw_norm")(x))
    if cfg.use_post_ffw_norm:
      h = RMSNorm(eps, name="post_ffw_norm")(h)
    return x + h, pool_k, pool_v


class Gemma(nn.Module):
  """Decoder over explicit positions and masks.

  tokens, positions: [B, Q]; mask: [B, Q, S] bool (S = Q without a pool, else pool slots), or the thread
  metadata it comes from (`visibility.ThreadMask`), which `attention` then reads: "xla" builds the dense mask
  once per call, "pallas" (or "pallas-tpu" / "pallas-gpu") computes it tile by tile in a kernel;
  pool: KVPool or None; slots: [B, Q] pool slots the new K/V go to (>= S drops the row);
  kv_positions: [B, S] positions of pool slots (for sliding-window layers).
  Returns a `ModelOutput` (model/output.py): logits [B, Q, V] float32 and the pool written (or None), and what
  else the call's flags asked for; with defer_writes the pool is only read and `kv` holds the new rows
  (`kv_rows.FreshKV`), which the caller writes (`kv_rows.write_fresh`).
  """

  config: GemmaConfig
  dtype: jnp.dtype = jnp.float32
  remat: bool = False  # training: keep only each layer's input, recompute the rest in the backward pass
  # Training on a mesh: pin activations to the batch sharding (examples over data x fsdp). Without it XLA
  # may gather the whole micro-batch onto every device instead of gathering the fsdp-sharded weights.
  mesh: jax.sharding.Mesh | None = None
  decode_layout: bool = False  # params from `to_decode_layout` (decoding: few rows per call)
  adapter: AdapterConfig | None = None  # unfolded LoRA + embedding rows (training); decoding folds them
  attention: str = "xla"  # "xla" or "pallas": how attention reads a ThreadMask (model/thread_attention.py)
  # Decode layout only: the output head reads a copy of the tied embedding stored in this narrower dtype (param
  # HEAD_COPY, written by `api.decode_params(head_dtype=)`); None: the embedding itself, in `dtype`.
  head_dtype: str | None = None
  head_plan: HeadPlan = FIXED_HEAD_PLAN  # decode layout: the output head's form per row count (model/head_plan.py)

  @nn.compact
  def __call__(self, tokens, positions, mask, pool: KVPool | None = None, slots=None, kv_positions=None, *,
               token_weights=None, logit_rows=None, defer_writes: bool = False, return_hidden: bool = False,
               skip_head: bool = False, hidden_after: int | None = None,
               row_select: RowSelect | None = None) -> ModelOutput:
    """Always returns one `ModelOutput` (model/output.py); the fields the call did not ask for are None.

    Inputs (besides the class's):
    token_weights: with tokens [B, Q, K] ids, [B, Q, K]: each input row is the weighted sum of K tokens'
      embeddings (a superposed input, as Superposed Decoding feeds).
    logit_rows: [B, R] the query rows whose logits (and head_input) are returned, [B, R, ...]; None: all Q.
      A prefill needs only the last prompt row's: the output head is most of a small model's work.
    defer_writes: with a pool, the pool is read only and `kv` holds the new rows (`kv_rows.FreshKV`): a decode
      step inside a `lax.switch` then writes them after it, in place, instead of XLA copying the pool.

    Outputs asked for (model/output.py has the table):
    by default logits [B, R, V] float32, and kv: the pool written (or the new rows), None without a pool.
    return_hidden: head_input [B, R, D] too, the final-normed hidden states (what Medusa heads read).
    skip_head: head_input in the logits' place, no logits: the caller multiplies the head itself
      (`decode.certified_head`) or needs only the hidden states (Medusa-1 training).
    hidden_after: early_hidden [B, Q, D] alone, the residual stream after that many layers (an early head's
      input); the deeper layers and the head do not run.
    row_select: ProPD's early pruning (`RowSelect`): kept [B, Q] bool too; logits and head_input are scattered
      back to [B, Q, ...], zeros at the rows cut."""
    cfg = self.config
    self._check_request(tokens, pool, logit_rows, return_hidden, skip_head, hidden_after, row_select)
    embedding = self.param("embedder", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.embed_dim))
    row_delta, x = self._embed(embedding, tokens, token_weights)
    x = x * jnp.asarray(cfg.embed_dim**0.5, self.dtype)
    x = self._constrain(x)
    if kv_positions is None:
      if pool is not None and "local" in cfg.layer_kinds:
        raise ValueError("kv_positions [B, S] is required with a pool: sliding-window layers compare positions")
      kv_positions = positions
    pk = None if pool is None else pool.k
    pv = None if pool is None else pool.v
    defer = defer_writes and pool is not None
    if isinstance(mask, ThreadMask) and self.attention == "xla":
      mask = mask.dense()  # once per call, not once per layer
    elif not isinstance(mask, ThreadMask) and self.attention != "xla":
      raise ValueError(f"attention={self.attention!r} reads the thread metadata: pass a visibility.ThreadMask, "
                       "not a dense mask")
    num_slots = None if pool is None else pk.shape[2]
    dense_defer = defer and not isinstance(mask, ThreadMask)
    base_mask = mask  # [B, Q, S] (or the metadata); deferred, the layers read [B, Q, S + Q], the new rows last
    mask = kv_rows.extend_mask(mask, slots) if dense_defer else mask
    block = nn.remat(Block) if self.remat else Block
    num_q, kept_rows, fresh, selected = x.shape[1], None, [], None
    for i, kind in enumerate(cfg.layer_kinds):
      if row_select is not None and i == row_select.layer:
        x, positions, mask, slots, *kept_rows = select_rows(row_select, x, tokens, positions, base_mask, slots,
                                                            num_slots)
        selected = (i, *kept_rows)
        mask = kv_rows.extend_mask(mask, slots) if dense_defer else mask
      if i == hidden_after:
        return ModelOutput(early_hidden=x)
      layer = block(cfg, kind, i, self.decode_layout, self.adapter, self.attention, defer, name=f"layer_{i}")
      layer_kv = jnp.concatenate([kv_positions, positions], axis=1) if dense_defer else kv_positions
      if defer:
        x, k_rows, v_rows = layer(x, positions, mask, layer_kv, pk, pv, slots)
        fresh.append((k_rows, v_rows, slots))
      else:
        x, pk, pv = layer(x, positions, mask, layer_kv, pk, pv, slots)
      x = self._constrain(x)
    x = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
    if logit_rows is not None:
      x = jnp.take_along_axis(x, logit_rows[..., None], axis=1)  # [B, R, D]
    kv = None if pool is None else KVPool(pk, pv)
    if defer:
      kv = kv_rows.stack_layers(fresh, num_q, num_slots, selected)
    out = ModelOutput(logits=None if skip_head else self._logits(x, embedding, row_delta),
                      head_input=x if return_hidden or skip_head else None, kv=kv)
    return out if row_select is None else scatter_kept(out, *kept_rows, num_q)

  def _check_request(self, tokens, pool, logit_rows, return_hidden, skip_head, hidden_after, row_select):
    """Refuses outputs that cannot be given together, before any work."""
    layers = self.config.num_layers
    if row_select is not None and (logit_rows is not None or pool is None or tokens.ndim != 2):
      raise ValueError("row_select prunes decode rows over a pool: not with logit_rows, a full sequence or mixes")
    if row_select is not None and not 0 < row_select.layer < layers:
      raise ValueError(f"row_select.layer must be in [1, {layers}), got {row_select.layer}")
    if hidden_after is not None and not 0 <= hidden_after < layers:
      raise ValueError(f"hidden_after must be in [0, {layers}), got {hidden_after}")
    if hidden_after is not None and (return_hidden or skip_head or row_select is not None):
      raise ValueError("hidden_after stops the call early: it returns early_hidden alone, without the final "
                       "hidden states or pruning")
    if skip_head and self.adapter is not None and self.adapter.row_ids:
      raise ValueError("skip_head needs the adapter's embedding rows folded in (lora.fold)")

  def _logits(self, x, embedding, row_delta):
    """Final-normed x [B, R, D] -> float32 logits [B, R, V] from the tied head, softcapped."""
    logits = output_head(x, self._unembed(embedding), self.decode_layout, self.head_plan)
    if row_delta is not None:  # the tied head's rows move with the embedding
      extra = jnp.einsum("bqd,nd->bqn", x, row_delta, preferred_element_type=jnp.float32)
      logits = logits.at[..., jnp.asarray(self.adapter.row_ids)].add(extra)
    return self._constrain(softcap(logits, self.config.final_logit_softcap), last="tensor")

  def _unembed(self, embedding):
    """The tied head: the embedding [V, D] (already [out, in], so in both layouts), or its narrow copy [D, V]."""
    if self.head_dtype is None:
      return embedding.astype(self.dtype)
    if not self.decode_layout:
      raise ValueError("head_dtype is a decode-layout option (api.decode_params writes the narrow head)")
    return self.param(HEAD_COPY, nn.initializers.normal(1.0), embedding.shape[::-1], jnp.dtype(self.head_dtype))

  def _embed(self, embedding, tokens, token_weights):
    """(row_delta or None, input rows [B, Q, D] before the sqrt(D) scale)."""
    if (token_weights is None) != (tokens.ndim == 2) or (
        token_weights is not None and token_weights.shape != tokens.shape):
      raise ValueError(f"tokens must be [B, Q] ids, or [B, Q, K] ids with token_weights [B, Q, K]; got "
                       f"{tokens.shape} and {None if token_weights is None else token_weights.shape}")
    x = jnp.take(embedding, tokens, axis=0).astype(self.dtype)  # [B, Q, (K,) D]
    row_delta, row_match = self._row_delta(tokens)
    if row_delta is not None:  # == looking up (embedder + delta at row_ids), as `lora.fold` stores it
      x = x + jnp.einsum("...n,nd->...d", row_match, row_delta)
    if token_weights is not None:
      x = jnp.einsum("bqk,bqkd->bqd", token_weights.astype(self.dtype), x)
    return row_delta, x

  def _row_delta(self, tokens):
    """(row_delta [n, D], one-hot [B, Q, (K,) n] of tokens on those rows), or (None, None) without rows."""
    if self.adapter is None or not self.adapter.row_ids:
      return None, None
    ids = jnp.asarray(self.adapter.row_ids, jnp.int32)
    delta = self.param(ROWS, nn.initializers.zeros_init(), (len(ids), self.config.embed_dim)).astype(self.dtype)
    return delta, (tokens[..., None] == ids).astype(self.dtype)

  def _constrain(self, x: Array, last: str | None = None) -> Array:
    return x if self.mesh is None else _batch_constraint(x, self.mesh, last)


def _batch_constraint(x: Array, mesh, last: str | None) -> Array:
  """[B, Q, X] pinned to examples over data x fsdp (and X over `last` when it divides)."""
  from jax.sharding import NamedSharding, PartitionSpec
  batch_axes = ("data", "fsdp")
  if x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
    return x
  if last is not None and x.shape[-1] % mesh.shape[last]:
    last = None
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(batch_axes, None, last)))


def causal_mask(batch: int, length: int, lengths: Array | None = None) -> Array:
  """[B, L, L] causal mask, from the one visibility rule: one thread writes position i in order i and
  row q's horizon is q. With lengths [B], keys past each row's length are not valid."""
  idx = jnp.arange(length, dtype=jnp.int32)
  order = jnp.broadcast_to(idx, (batch, length))
  valid = order < (length if lengths is None else lengths[:, None])
  horizon = jnp.broadcast_to(idx[:, None], (batch, length, 1))  # [B, Q, U=1]
  return visible(horizon, jnp.zeros_like(order), order, valid)
