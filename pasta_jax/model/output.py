"""What one model call returns: `ModelOutput`, the contract of `Gemma` and of every stand-in for it
(decode/toy_model.py, the fake models of tests and benchmarks).

A call always returns one `ModelOutput`; the flags of the call say which fields it fills, and the others are None.
So a caller reads outputs by name, never by position, and a field it did not ask for fails loudly (it is None)
instead of quietly holding another output. It is a pytree, so it crosses jit, `lax.switch` and `lax.cond`
boundaries; None fields are empty subtrees and cost nothing.

  the call asks               logits  head_input  kv    early_hidden  kept
  (nothing)                   yes     -           yes   -             -
  return_hidden=True          yes     yes         yes   -             -
  skip_head=True              -       yes         yes   -             -
  hidden_after=n              -       -           -     yes           -
  row_select=...              as asked, rows cut are zeros            yes

kv is None without a pool; with one it is the pool written (`KVPool`), or, with defer_writes, only the call's new
rows (`kv_rows.FreshKV`), which the caller writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
  """One model call's outputs (B requests, Q query rows, R = the logit_rows asked for, else Q)."""

  logits: Array | None = None  # [B, R, V] float32, softcapped; None with skip_head or hidden_after
  head_input: Array | None = None  # [B, R, D] final-normed hidden states (the output head's input)
  # (typed by name only: `gemma.KVPool` or `kv_rows.FreshKV`; gemma imports this module)
  kv: Any = None  # the pool written [layers, B, S, K, hd], or the new rows [layers, B, Q, K, hd]
  early_hidden: Array | None = None  # [B, Q, D] residual stream after `hidden_after` layers (an early head's input)
  kept: Array | None = None  # [B, Q] bool: the rows early pruning (row_select) ran through the deep layers

  def present(self) -> tuple[str, ...]:
    """The names of the fields this call filled, in field order."""
    return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)
