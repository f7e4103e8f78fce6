"""ProPD's early pruning (paper 004, section 4.1): cut a token tree's unlikely branches after a few layers.

After `layer` layers an early prediction head reads every tree node's residual stream and lists its top-K
successors. A node whose token is not in its parent's list is pruned, and so is everything under it (the
root is never pruned). The first M surviving nodes in node order (parents come first, so the kept set is
ancestor-closed) run the deep layers and the output head; M = ceil(keep x Q) for a bucket of Q rows is a
static count, so XLA compiles one program per lane bucket and the deep layers' work really shrinks.

Pruning never changes what greedy acceptance writes: a pruned node is simply not accepted, and the root, whose
successor is the step's plain greedy token, always runs the whole model. It only trades accepted length
for step time, and ProPD's step-time calibration times the pruned program.

The early head: z = n + SiLU(W n + b), n = RMSNorm(x) with its own scale, ranked over the Medusa heads' draft
vocabulary rows of the tied output head (the candidates are draft-vocabulary tokens, so the list decides every
node). Its identity start (W = 0, b = 0, the final norm's scale) is the "logit lens"; `train.medusa --stages
early` trains it on the model's own greedy answers, as ProPD trains its early head. Untrained it is useless on a
shallow layer (on the 270M at layer 4 the next token is in the logit lens's top 50 for 4% of positions), so
ProPD prunes by default only with a trained head.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

EARLY_HEAD_KEYS = ("norm", "w", "b")


@dataclasses.dataclass(frozen=True)
class EarlyPrune:
  """Static settings of early pruning (part of the jit-static MedusaRules)."""

  layer: int = 4  # the paper's choice for 7B-33B models
  top_k: int = 50  # the paper's choice
  keep: float = 0.5  # share of a bucket's rows that go on past `layer`
  min_size: int = 4  # buckets of fewer rows are not pruned (too little to save)
  eps: float = 1e-6  # the early norm's epsilon (the model's)

  def __post_init__(self):
    if self.layer < 1 or self.top_k < 1 or not 0.0 < self.keep <= 1.0 or self.min_size < 2:
      raise ValueError(f"early pruning needs layer >= 1, top_k >= 1, 0 < keep <= 1, min_size >= 2: {self}")

  def rows_kept(self, num_q: int) -> int:
    """M, the rows of a Q-row bucket that run the deep layers (Q: no pruning in small buckets)."""
    return num_q if num_q < self.min_size else max(1, math.ceil(self.keep * num_q))


def logit_lens_head(final_norm_scale: jax.Array) -> dict:
  """The untrained early head: the model's final norm and output head read at an early layer."""
  dim = final_norm_scale.shape[0]
  return {"norm": jnp.asarray(final_norm_scale, jnp.float32), "w": jnp.zeros((dim, dim), jnp.float32),
          "b": jnp.zeros((dim,), jnp.float32)}


def early_head_logits(head: dict, x: jax.Array, drafted: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x [..., D] the residual stream after the early layers -> logits [..., Vd] over the draft rows `drafted`."""
  x32 = x.astype(jnp.float32)
  n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * (1.0 + head["norm"])
  z = n + jax.nn.silu(n @ head["w"] + head["b"])
  return jnp.einsum("...d,vd->...v", z.astype(drafted.dtype), drafted, preferred_element_type=jnp.float32)


def early_top_tokens(head: dict, x, drafted, vocab_ids, top_k: int, eps: float = 1e-6) -> jax.Array:
  """[..., top_k] int32 the early head's most likely successor ids (vocab_ids maps draft rows to ids; None: all)."""
  ranks = jax.lax.top_k(early_head_logits(head, x, drafted, eps), top_k)[1]
  return (ranks if vocab_ids is None else vocab_ids[ranks]).astype(jnp.int32)


def surviving_nodes(top: jax.Array, tokens: jax.Array, parent: np.ndarray, depth: np.ndarray) -> jax.Array:
  """[B, Q] bool: nodes whose token is in their parent's early list, all the way up (the root survives).
  top: [B, Q, K] each node's early successor list; tokens: [B, Q]; parent, depth: [Q] static."""
  parent_list = top[:, np.maximum(parent, 0)]  # [B, Q, K]
  listed = jnp.any(parent_list == tokens[..., None], axis=-1)
  alive = jnp.broadcast_to(jnp.asarray(depth == 0), tokens.shape)
  for level in range(1, int(depth.max(initial=0)) + 1):  # parents first: one pass per depth
    alive = alive | (jnp.asarray(depth == level)[None] & listed & alive[:, np.maximum(parent, 0)])
  return alive


def first_rows(alive: jax.Array, keep: int) -> tuple[jax.Array, jax.Array]:
  """(rows [B, M], ok [B, M]): the first `keep` surviving nodes in node order, then padding (ok False)."""
  num_q = alive.shape[1]
  order = jnp.where(alive, 0, num_q) + jnp.arange(num_q)[None, :]
  rows = jnp.argsort(order, axis=1)[:, :keep].astype(jnp.int32)
  return rows, jnp.take_along_axis(alive, rows, axis=1)


EARLY_WEIGHTS = "early.safetensors"
EARLY_CONFIG = "early.json"


def save_early_head(folder, head: dict, meta: dict | None = None):
  """early.safetensors (norm, w, b) + early.json (the layer it reads, training figures) in a heads folder."""
  import json
  from pathlib import Path

  from safetensors.numpy import save_file
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  save_file({k: np.asarray(head[k], np.float32) for k in EARLY_HEAD_KEYS}, str(folder / EARLY_WEIGHTS))
  (folder / EARLY_CONFIG).write_text(json.dumps(meta or {}, indent=1))
  return folder


def load_early_head(folder) -> tuple[dict, int] | None:
  """(the early head, the layer it reads) saved in a heads folder, or None when it has none."""
  import json
  from pathlib import Path

  from safetensors.numpy import load_file
  path = Path(folder) / EARLY_WEIGHTS
  if not path.exists():
    return None
  head = load_file(str(path))
  if set(head) != set(EARLY_HEAD_KEYS):
    raise ValueError(f"{path}: expected tensors {EARLY_HEAD_KEYS}, found {sorted(head)}")
  meta = json.loads((Path(folder) / EARLY_CONFIG).read_text()) if (Path(folder) / EARLY_CONFIG).exists() else {}
  if "layer" not in meta:
    raise ValueError(f"{Path(folder) / EARLY_CONFIG}: the early head's layer is not recorded")
  return head, int(meta["layer"])
