"""Medusa-1 heads on a frozen base: the loss sum_k 0.8^k CE(head_k) (`pasta_jax.model.medusa`) over the base's
hidden states, computed once and cached, the softmax over a draft vocabulary of the most frequent tokens;
then per-head top-k hit rates on held-out rows, the prior of the tree builder and of ProPD.

Every file is written whole under a temporary name and renamed (`runfiles`); the heads folder is published
with its completion marker last, which is what a resume checks (`heads_done`)."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pasta_jax.data.sources import read_records
from pasta_jax.model import medusa, runfiles
from pasta_jax.training.medusa.distill import POOLS, padded_batches


def hidden_and_targets(model, rows: list[dict], num_heads: int, cache: Path | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The frozen base's last hidden states at every training position t ([M, D]), the heads' targets [M, H]
  and the token at t + 1 [M] (what next_token heads read), cached in `cache` (an .npz; recomputed when the rows
  or the head count change)."""
  key = f"{len(rows)}-{num_heads}-{sum(len(r['answer_ids']) for r in rows)}-{model.source}"
  if cache is not None and cache.exists():
    saved = np.load(cache)
    if str(saved["key"]) == key and "next_tokens" in saved:
      return saved["states"], saved["targets"], saved["next_tokens"]
  states, targets, next_tokens = compute_hidden(model, rows, num_heads)
  if cache is not None:
    runfiles.save_atomic(cache, lambda tmp: np.savez(tmp, states=states, targets=targets, next_tokens=next_tokens,
                                                     key=key))
  return states, targets, next_tokens


def compute_hidden(model, rows: list[dict], num_heads: int, batch: int = 4
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  import jax
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma, causal_mask
  module = Gemma(model.config)

  @jax.jit
  def hidden(tokens, lengths):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return module.apply(model.params, tokens, positions, causal_mask(*tokens.shape, lengths),
                        skip_head=True).head_input

  states, targets, next_tokens = [], [], []
  for chunk, seqs, tokens, lengths in padded_batches(rows, batch, "hidden states (frozen base)"):
    h = np.asarray(hidden(jnp.asarray(tokens), jnp.asarray(lengths)))
    for i, (seq, r) in enumerate(zip(seqs, chunk)):
      pos, tgt = medusa.position_targets(seq, len(r["prompt_ids"]), num_heads)
      states.append(h[i, pos])
      targets.append(tgt)
      next_tokens.append(seq[pos + 1])  # position_targets' positions end at T - 3
  return np.concatenate(states).astype(np.float32), np.concatenate(targets), np.concatenate(next_tokens)


def draft_vocabulary(model, rows: list[dict], size: int, cache: Path) -> np.ndarray:
  """The `size` most frequent token ids of the distilled answers and the training pools' text, most frequent
  first: the tokens the heads rank (model/medusa.py, draft vocabulary). Cached in `cache`."""
  if cache.exists():
    saved = np.load(cache)
    if len(saved) >= size:
      return saved[:size]
  counts: collections.Counter = collections.Counter(t for r in rows for t in r["answer_ids"])
  for pool in POOLS:
    for record in tqdm(read_records(pool), desc=f"token counts of {pool}", leave=False):
      for field in ("instruction", "input", "output"):
        if record.get(field):
          counts.update(model.tokenizer.encode(record[field], add_bos=False))
  vocab = np.asarray([t for t, _ in counts.most_common(size)], np.int64)
  runfiles.save_atomic(cache, lambda tmp: np.save(tmp, vocab))
  return vocab


def train_heads(model, rows: list[dict], out: Path, config, epochs: int, batch: int, lr: float,
                vocab_size: int = 16384, seed: int = 0) -> dict:
  """Medusa-1: frozen base, the heads' residual blocks trained on cached hidden states (AdamW, cosine), the
  softmax over the draft vocabulary (the `vocab_size` most frequent tokens; 0: the whole vocabulary). Targets
  outside it are left out of the loss: the heads could never propose them."""
  import jax
  import jax.numpy as jnp
  import optax
  states, targets, next_tokens = hidden_and_targets(model, rows, config.num_heads, out / "hidden_train.npz")
  unembed = model.params["params"]["embedder"]
  softcap = model.config.final_logit_softcap
  vocab = draft_vocabulary(model, rows, vocab_size, out / "vocab.npy") if vocab_size else None
  drafted = unembed if vocab is None else unembed[jnp.asarray(vocab)]
  if vocab is not None:
    remap = np.full(unembed.shape[0], -1, np.int64)
    remap[vocab] = np.arange(len(vocab))
    targets = np.where(targets >= 0, remap[np.maximum(targets, 0)], -1)
  heads = medusa.init_heads(config, unembed)  # the trained part; the draft vocabulary joins it when saved
  steps = epochs * (len(states) // batch)
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps), weight_decay=0.0)
  opt_state = optimizer.init(heads)

  @jax.jit
  def update(heads, opt_state, h, t, nxt, embedding):
    next_embed = medusa.next_features(embedding, nxt) if config.next_token else None
    (loss, per_head), grads = jax.value_and_grad(medusa.medusa_loss, has_aux=True)(heads, h, t, drafted, config,
                                                                                  softcap, next_embed)
    updates, opt_state = optimizer.update(grads, opt_state, heads)
    return optax.apply_updates(heads, updates), opt_state, loss, per_head

  rng = np.random.default_rng(seed)
  history = []
  with tqdm(total=steps, desc="train Medusa heads") as bar:
    for _ in range(epochs):
      order = rng.permutation(len(states))
      for i in range(len(states) // batch):
        pick = order[i * batch:(i + 1) * batch]
        heads, opt_state, loss, per_head = update(heads, opt_state, jnp.asarray(states[pick]),
                                                  jnp.asarray(targets[pick]), jnp.asarray(next_tokens[pick]), unembed)
        history.append([float(loss)] + [float(x) for x in per_head])
        bar.set_postfix(loss=f"{float(loss):.3f}")
        bar.update()
  meta = {"base": Path(str(model.source)).name, "positions": int(len(states)), "steps": steps, "epochs": epochs,
          "draft_vocab": int(drafted.shape[0]), "targets_in_draft_vocab": float((targets >= 0).mean()),
          "batch": batch, "lr": lr, "first_loss": history[0], "last_loss": history[-1],
          "sizes": medusa.head_sizes(config, *model.params["params"]["embedder"].shape)}
  if vocab is not None:
    heads = {**heads, "vocab": jnp.asarray(vocab, jnp.int32)}
  runfiles.write_json(out / "train_loss.json", history, indent=None)
  with runfiles.publishing(out / "heads") as folder:  # last: a complete heads folder means the stage is done
    medusa.save_heads(folder, heads, config, meta)
  return meta


def heads_done(out: Path) -> bool:
  """Whether the heads stage finished: its folder was published whole (`train_heads`)."""
  return runfiles.is_complete(out / "heads")


def head_ranks(model, heads: dict, config, states: np.ndarray, next_tokens: np.ndarray, top_k: int) -> np.ndarray:
  """[M, H, top_k] each head's top tokens at every position: states [M, D] the base's hidden states there,
  next_tokens [M] the token at t + 1 (read by next_token heads only), in chunks of 256 positions."""
  import jax
  import jax.numpy as jnp
  embedding = model.params["params"]["embedder"]
  drafted = medusa.draft_unembed(heads, embedding)

  @jax.jit
  def top(h, nxt, embedding):
    next_embed = medusa.next_features(embedding, nxt) if config.next_token else None
    return medusa.head_top_tokens(heads, h, drafted, top_k, model.config.final_logit_softcap, next_embed)

  return np.concatenate([np.asarray(top(jnp.asarray(states[i:i + 256]), jnp.asarray(next_tokens[i:i + 256]),
                                        embedding)) for i in range(0, len(states), 256)])


def calibrate(model, rows: list[dict], out: Path, top_k: int) -> dict:
  """Per-head top-k hit rates on held-out distilled answers: P(head h's rank-r token is the target)."""
  heads, config, _ = medusa.load_heads(out / "heads")
  states, targets, next_tokens = hidden_and_targets(model, rows, config.num_heads, out / "hidden_held_out.npz")
  ranks = head_ranks(model, heads, config, states, next_tokens, top_k)  # [M, H, k]
  hits = ((ranks == targets[:, :, None]) & (targets[:, :, None] >= 0)).sum(axis=0)
  rates = hits / np.maximum((targets >= 0).sum(axis=0), 1)[:, None]
  info = {"hit_rates": rates.tolist(), "top1": rates[:, 0].tolist(), "topk": rates.sum(axis=1).tolist(),
          "positions": int(len(states)), "prompts": len(rows)}
  runfiles.write_json(out / "heads" / "calibration.json", info)
  return info
