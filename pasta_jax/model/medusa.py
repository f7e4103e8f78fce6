"""Medusa heads (paper 004's drafter; Medusa, Cai et al. 2024): K extra next-next-token predictors.

Head k (k = 0 .. K-1) reads the base model's last hidden state h_t (after the final norm) and predicts the
token at t + 2 + k (the base's own head predicts t + 1):

  z_k = h_t + SiLU(W_k h_t + b_k)        one residual block, W_k zero-initialised (a fresh head = the base head)
  logits_k = softcap(z_k E^T)             E: the model's tied output head (shared), or a head of its own

With `next_token=True` each head also reads the token at t + 1 (Hydra, Ankner et al. 2024, in its simplest
form): a tree's root is the base model's own choice, certain before the heads run, so the heads may condition
on it: z_k = h_t + SiLU(W_k h_t + U_k e(x_{t+1}) + b_k), e the tied embedding row scaled to unit RMS, U_k
zero-initialised. Knowing x_{t+1} is most of what predicting x_{t+2} needs that h_t lacks.

With `width=F > 0` each head's block is two layers wide (Hydra++'s deeper heads, in their simplest form):
z_k = h_t + V_k SiLU(W_k h_t [+ U_k e(x_{t+1})] + b_k), W_k and U_k [D, F], V_k [F, D]. V_k starts at zero (a fresh
head is again the base head) and W_k at random (a zero W_k would leave every gradient of V_k zero).

Gemma 3 270M's output head is 262k x 640, most of the model, so by default every head shares it: the heads
then own only K x (D x D + D) parameters (1.6M, 6.6 MB in float32, for K = 4 on the 270M); an own head per
Medusa head adds K x V x D (168M per head on the 270M). `head_sizes` reports both.

A draft vocabulary (`vocab`, optional): the heads rank only these tokens (the most frequent of the training
text), as FR-Spec restricts a drafter's head to frequent tokens. On a CPU the 262k-row head is compute-bound
from two rows on, so four heads over the whole vocabulary would cost more than the tokens they save;
verification still reads the full head, so decoding stays exact.

Medusa-1 training (frozen base): loss = sum_k decay^k CE(logits_k, token_{t+2+k}), decay 0.8 (the paper's
lambda_k), over the answer positions of self-distilled sequences.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.errors import WeightsError
from pasta_jax.model import runfiles

CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"
DRAFT_DTYPE = jnp.bfloat16  # the draft rows while decoding (`draft_rows`)


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
  num_heads: int = 4  # K
  shared_head: bool = True  # project through the model's tied output head (False: each head owns a V x D copy)
  decay: float = 0.8  # loss weight of head k: decay ** k
  next_token: bool = False  # the heads also read the embedding of the token at t + 1 (the tree's root)
  width: int = 0  # F: each head's block D -> F -> D (0: Medusa's one D x D block)

  def __post_init__(self):
    if not 1 <= self.num_heads <= 8:
      raise ValueError(f"num_heads must be in [1, 8], got {self.num_heads}")
    if self.width < 0:
      raise ValueError(f"width must be 0 (one D x D block) or positive, got {self.width}")


def init_heads(config: MedusaConfig, unembed: jax.Array, vocab=None, seed: int = 0) -> dict:
  """Fresh heads for a model whose output head is `unembed` [V, D]: each starts as the base head
  (zero residual weights, or with `width` a zero output matrix V; an own head starts as a copy of the base's).
  vocab: the draft vocabulary (token ids the heads rank, most frequent first), or None for all V. seed: a wide
  block's random W."""
  k, dim = config.num_heads, unembed.shape[1]
  inner = config.width or dim
  if config.width:
    w = jax.random.normal(jax.random.key(seed), (k, dim, inner), jnp.float32) / np.sqrt(dim)
  else:
    w = jnp.zeros((k, dim, inner), jnp.float32)
  heads = {"w": w, "b": jnp.zeros((k, inner), jnp.float32)}
  if config.width:
    heads["v"] = jnp.zeros((k, inner, dim), jnp.float32)
  if config.next_token:
    heads["u"] = jnp.zeros((k, dim, inner), jnp.float32)
  if vocab is not None:
    heads["vocab"] = jnp.asarray(vocab, jnp.int32)
  if not config.shared_head:
    rows = draft_unembed(heads, unembed).astype(jnp.float32)
    heads["out"] = jnp.broadcast_to(rows, (config.num_heads,) + rows.shape)
  return heads


def next_features(embedding: jax.Array, tokens: jax.Array) -> jax.Array:
  """The tied embedding rows of `tokens` [...] (embedding [V, D]), each scaled to unit RMS: [..., D] float32,
  what a `next_token` head reads of x_{t+1} (the scale keeps U's learning rate that of W, whose input h_t is
  the final norm's output)."""
  rows = embedding[tokens].astype(jnp.float32)
  return rows * jax.lax.rsqrt(jnp.mean(rows * rows, axis=-1, keepdims=True) + 1e-6)


def _mixed(heads: dict, x: jax.Array, name: str) -> jax.Array:
  """x [..., D] through each head's [D, F] matrix `name`: [..., K, F]."""
  num_heads = heads["b"].shape[0]
  return jnp.einsum("...kd,kde->...ke", jnp.broadcast_to(x[..., None, :], x.shape[:-1] + (num_heads, x.shape[-1])),
                    heads[name])


def head_states(heads: dict, hidden: jax.Array, next_embed: jax.Array | None = None) -> jax.Array:
  """hidden [..., D] -> each head's residual output [..., K, D]. next_embed [..., D]: `next_features` of the
  token at t + 1, which heads trained with `next_token` read (and others must not be given)."""
  if ("u" in heads) != (next_embed is not None):
    raise ValueError("heads trained with next_token=True read the next token's features (next_embed), and only "
                     "they do" if "u" in heads else "these heads do not read the next token (next_token=False)")
  h = hidden.astype(jnp.float32)
  pre = _mixed(heads, h, "w") + heads["b"]  # [..., K, F]
  if next_embed is not None:
    pre = pre + _mixed(heads, next_embed.astype(jnp.float32), "u")
  update = jax.nn.silu(pre)
  if "v" in heads:  # a wide block's second layer, F -> D
    update = jnp.einsum("...kf,kfd->...kd", update, heads["v"])
  return h[..., None, :] + update


def head_logits(heads: dict, hidden: jax.Array, unembed: jax.Array, softcap: float | None = None,
                next_embed: jax.Array | None = None) -> jax.Array:
  """hidden [..., D] -> logits [..., K, V] of the K heads (each row of the shared head is read once for
  all K heads: one [.. K, D] x [D, V] product)."""
  z = head_states(heads, hidden, next_embed)
  if "out" in heads:
    logits = jnp.einsum("...kd,kvd->...kv", z, heads["out"].astype(z.dtype), preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("...kd,vd->...kv", z.astype(unembed.dtype), unembed, preferred_element_type=jnp.float32)
  if softcap:
    logits = jnp.tanh(logits / softcap) * softcap
  return logits


def draft_unembed(heads: dict, unembed: jax.Array) -> jax.Array:
  """The output-head rows the heads rank: the draft vocabulary's ([Vd, D]), or the whole head."""
  return unembed[heads["vocab"]] if "vocab" in heads else unembed


def bind_rows(rule_inputs: dict, embedding: jax.Array) -> dict:
  """A tree rule's inputs with what its heads read of the model's tied embedding [V, D], gathered once per run:
  the draft rows (`draft_rows`), and for next_token heads the embedding itself (`next_features` at each step)."""
  bound = dict(rule_inputs)
  if "drafted" not in bound:
    bound["drafted"] = draft_rows(bound["heads"], embedding)
  if "u" in bound["heads"] and "embedding" not in bound:
    bound["embedding"] = embedding
  return bound


def rule_top_tokens(inputs: dict, hidden: jax.Array, next_tokens: jax.Array, top_k: int,
                    softcap: float | None = None) -> jax.Array:
  """`head_top_tokens` inside a tree rule (inputs: `bind_rows`'): hidden [..., D] at a path's last node,
  next_tokens [...] the base model's choice there (the next tree's root), read by next_token heads only."""
  heads = inputs["heads"]
  next_embed = next_features(inputs["embedding"], next_tokens) if "u" in heads else None
  return head_top_tokens(heads, hidden, inputs["drafted"], top_k, softcap, next_embed)


def draft_rows(heads: dict, unembed: jax.Array) -> jax.Array:
  """`draft_unembed`'s rows as decoding ranks them: in bfloat16 (float32 accumulation). The heads only propose;
  the model's own head verifies every proposal, so a narrower copy changes which tokens are drafted, never which
  are kept. On a 2-core CPU it halves the heads' cost a tree step (16k x 640 rows for 4 heads: about 1.2 ms
  against 2.5)."""
  return draft_unembed(heads, unembed).astype(DRAFT_DTYPE)


def head_top_tokens(heads: dict, hidden: jax.Array, drafted: jax.Array, top_k: int,
                    softcap: float | None = None, next_embed: jax.Array | None = None) -> jax.Array:
  """hidden [..., D] -> [..., H, top_k] int32 each head's most likely token ids. drafted: `draft_unembed`'s
  rows (gathered once per run, not per step); next_embed: as `head_states`."""
  ranks = jax.lax.top_k(head_logits(heads, hidden, drafted, softcap, next_embed), top_k)[1]
  return (heads["vocab"][ranks] if "vocab" in heads else ranks).astype(jnp.int32)


def medusa_loss(heads: dict, hidden: jax.Array, targets: jax.Array, unembed: jax.Array, config: MedusaConfig,
                softcap: float | None = None, next_embed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Medusa-1 loss: hidden [M, D] (h_t after token t), targets [M, H] (token t + 2 + h, -1 where there is
  none), next_embed [M, D] (`next_features` of token t + 1, for next_token heads). Returns (sum_h decay^h mean
  CE_h, [H] per-head mean CE)."""
  logits = head_logits(heads, hidden, unembed, softcap, next_embed)  # [M, H, V]
  valid = targets >= 0
  log_p = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.take_along_axis(log_p, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]  # [M, H]
  per_head = jnp.sum(ce * valid, axis=0) / jnp.maximum(valid.sum(axis=0), 1)
  return jnp.sum(per_head * config.decay ** jnp.arange(config.num_heads)), per_head


def position_targets(tokens: np.ndarray, first: int, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
  """Training positions of one sequence [T]: t = first - 1 .. T - 3 (h_t predicts an answer token at t + 2 + h
  when `first` is the answer's first index). Returns (positions [M], targets [M, H], -1 past the end)."""
  length = len(tokens)
  positions = np.arange(max(first - 1, 0), max(length - 2, 0))
  targets = np.full((len(positions), num_heads), -1, np.int64)
  for h in range(num_heads):
    at = positions + 2 + h
    ok = at < length
    targets[ok, h] = tokens[at[ok]]
  return positions, targets


def head_sizes(config: MedusaConfig, vocab: int, dim: int) -> dict:
  """Parameter counts of the heads with the shared output head and with an own head per Medusa head."""
  inner = config.width or dim
  second = inner * dim if config.width else 0
  residual = config.num_heads * ((2 if config.next_token else 1) * dim * inner + inner + second)
  return {"shared": residual, "own": residual + config.num_heads * vocab * dim}


def save_heads(folder: str | Path, heads: dict, config: MedusaConfig, meta: dict | None = None) -> Path:
  """heads.safetensors + heads.json (config and free-form metadata: the base model, training figures)."""
  from safetensors.numpy import save_file
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  save_file({k: np.asarray(v, np.int32 if k == "vocab" else np.float32) for k, v in heads.items()},
            str(folder / WEIGHTS_FILE))
  (folder / CONFIG_FILE).write_text(json.dumps({"config": dataclasses.asdict(config), "meta": meta or {}}, indent=1))
  return folder


def load_heads(folder: str | Path) -> tuple[dict, MedusaConfig, dict]:
  """(heads, config, meta) from a folder `save_heads` wrote; a clear error for anything else."""
  from safetensors.numpy import load_file
  folder = Path(folder)
  if not (folder / CONFIG_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
    raise WeightsError(f"{folder} holds no Medusa heads ({CONFIG_FILE} and {WEIGHTS_FILE} expected)")
  info = runfiles.read_json_file(folder / CONFIG_FILE, WeightsError)
  config = MedusaConfig(**info["config"])
  heads = {k: jnp.asarray(v) for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
  if (heads["w"].shape[0] != config.num_heads or ("out" in heads) == config.shared_head
      or ("u" in heads) != config.next_token or ("v" in heads) != bool(config.width)
      or heads["b"].shape[-1] != (config.width or heads["w"].shape[1])):
    raise WeightsError(f"{folder}: weights do not match {CONFIG_FILE} ({config})")
  return heads, config, info.get("meta", {})
