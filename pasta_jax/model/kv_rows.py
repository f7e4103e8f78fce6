"""A decode call's new K/V rows, kept out of the pool until the call returns (`Gemma(..., defer_writes=True)`).

Why: the decode step runs the model inside a `lax.switch` over lane-count buckets (decode/step.py). A branch that
writes the KV pool cannot write the loop's buffer in place: XLA copies the whole pool into the branch and back
(measured on a CPU: 150 MB a step for ProPD at batch 8, a size-1 step 1.16x a plain one). So inside the switch
the pool is only read, each layer attends over the pool's slots and over the call's own new rows, and the step
writes the rows after the switch (`write_fresh`), in place. (Without a switch the model writes as it goes: a
write after the reads in one computation costs XLA two copies of the pool instead.)

Where it pays: on a CPU (XLA:CPU copies a conditional's written operand; deferred, PASTA at batch 16 is 1.16x
faster and ProPD at batch 8 1.08x, bench.kv_writes). On an H100 the other way round: deferred, a one-lane step cost
1.73x plain decoding against 1.11x written in the branch (Gemma 3 270M, bf16, bench.seq_cost --defer off,on,
docs/results/bench_seq_cost_h100_defer.txt; not profiled: the deferred layers' extra work is two key segments,
the extended mask, and the rows stacked and scattered after the switch). So `defer_by_default` defers on a CPU only.

Masks: a row's slot already carries its metadata (the rules wrote owner, order, position before the call), so
the dense mask [B, Q, S] says which new rows a query sees: the columns at their slots. Those slots still hold
an earlier occupant's K/V in the pool, so the pool's columns there are hidden.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


def defer_by_default(backend: str | None = None) -> bool:
  """Whether the decode step defers its K/V writes when the configuration leaves it open (None): on a CPU only,
  where it was measured to pay (see above); `backend` defaults to JAX's."""
  return (backend or jax.default_backend()) == "cpu"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FreshKV:
  """The K/V rows one call computed, [layers, B, Q, kv_heads, head_dim], and the pool slot each row goes to, per
  layer, [layers, B, Q] (>= S: dropped; early pruning drops a cut row's deeper layers)."""

  k: Array
  v: Array
  slots: Array


def written_slots(slots: Array, num_slots: int) -> Array:
  """[B, S] bool: the slots the call's rows [B, Q] go to (a slot >= S goes nowhere)."""
  hit = jnp.zeros((slots.shape[0], num_slots + 1), bool)
  return hit.at[jnp.arange(slots.shape[0])[:, None], jnp.minimum(slots, num_slots)].set(True)[:, :num_slots]


def fresh_columns(mask: Array, slots: Array, num_slots: int) -> Array:
  """[B, Q, R] bool: query q sees new row r (mask [B, Q, S] at r's slot; a row without a slot is seen by none)."""
  at = jnp.take_along_axis(mask, jnp.minimum(slots, num_slots - 1)[:, None, :], axis=2)
  return at & (slots < num_slots)[:, None, :]


def extend_mask(mask: Array, slots: Array) -> Array:
  """[B, Q, S + R]: the pool's columns with the slots the rows [B, R] write hidden, then the rows' own columns."""
  num_slots = mask.shape[2]
  written = written_slots(slots, num_slots)
  return jnp.concatenate([mask & ~written[:, None, :], fresh_columns(mask, slots, num_slots)], axis=2)


def stack_layers(per_layer: list[tuple[Array, Array, Array]], num_q: int, num_slots: int,
                 selected: tuple[int, Array, Array] | None = None) -> FreshKV:
  """FreshKV from each layer's (k [B, R, K, hd], v, slots [B, R]). selected: (first layer, rows, ok [B, M]) when
  early pruning kept M of the Q rows from that layer on: those layers' rows are scattered back to Q rows, the
  rows cut dropped."""
  ks, vs, ss = [], [], []
  for i, (k, v, slots) in enumerate(per_layer):
    if selected is not None and i >= selected[0]:
      rows, ok = selected[1:]
      b = jnp.arange(k.shape[0])[:, None]
      at = jnp.where(ok, rows, num_q)
      k = jnp.zeros((k.shape[0], num_q) + k.shape[2:], k.dtype).at[b, at].set(k, mode="drop")
      v = jnp.zeros((v.shape[0], num_q) + v.shape[2:], v.dtype).at[b, at].set(v, mode="drop")
      slots = jnp.full((slots.shape[0], num_q), num_slots, slots.dtype).at[b, at].set(slots, mode="drop")
    ks.append(k)
    vs.append(v)
    ss.append(slots)
  return FreshKV(jnp.stack(ks), jnp.stack(vs), jnp.stack(ss))


def write_fresh(pool_k: Array, pool_v: Array, fresh: FreshKV) -> tuple[Array, Array]:
  """The pool [layers, B, S, K, hd] with the call's rows written at their slots (in place, outside any switch)."""
  layers = jnp.arange(fresh.k.shape[0])[:, None, None]
  batch = jnp.arange(fresh.k.shape[1])[None, :, None]
  k = pool_k.at[layers, batch, fresh.slots].set(fresh.k.astype(pool_k.dtype), mode="drop")
  v = pool_v.at[layers, batch, fresh.slots].set(fresh.v.astype(pool_v.dtype), mode="drop")
  return k, v
