"""ProPD's early prediction head (`decode/rules/pruning.py`): the residual stream after a few layers -> the
next token over the heads' draft vocabulary, trained on a frozen base from the logit lens as its start, and
measured on held-out rows before and after."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pasta_jax.model import medusa, runfiles
from pasta_jax.training.medusa.distill import padded_batches


def early_states(model, rows: list[dict], layer: int, batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """The residual stream after `layer` layers at every answer position t - 1 ([M, D]) and the next token [M]."""
  import jax
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma, causal_mask
  module = Gemma(model.config)
  stream = jax.jit(lambda tokens, lengths: module.apply(
      model.params, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
      causal_mask(*tokens.shape, lengths), hidden_after=layer).early_hidden)
  states, targets = [], []
  for chunk, seqs, tokens, lengths in padded_batches(rows, batch, f"residual stream after layer {layer}"):
    x = np.asarray(stream(jnp.asarray(tokens), jnp.asarray(lengths)))
    for i, (seq, r) in enumerate(zip(seqs, chunk)):
      pos = np.arange(len(r["prompt_ids"]) - 1, len(seq) - 1)
      states.append(x[i, pos])
      targets.append(seq[pos + 1])
  return np.concatenate(states).astype(np.float32), np.concatenate(targets)


def early_hit_rate(head, states, targets, drafted, vocab, top_k: int) -> float:
  """Share of positions whose next token is in the early head's top-K (what pruning keeps)."""
  import jax
  import jax.numpy as jnp

  from pasta_jax.decode.rules import pruning
  top = jax.jit(lambda x: pruning.early_top_tokens(head, x, drafted, vocab, top_k))
  hits = sum(int(np.sum(np.any(np.asarray(top(jnp.asarray(states[i:i + 512]))) == targets[i:i + 512, None], -1)))
             for i in range(0, len(states), 512))
  return hits / max(len(states), 1)


def heads_folder(model, out: Path) -> Path:
  """out/heads: the heads this run trained, else a copy of the model's shipped heads (the early head is saved
  beside them, never into the package)."""
  import shutil

  from pasta_jax.decode.speculation import load_drafter
  folder = out / "heads"
  if not runfiles.is_complete(folder) and not (folder / medusa.CONFIG_FILE).exists():  # never over trained heads
    shipped = Path(load_drafter(model).source)
    with runfiles.publishing(folder) as tmp:  # whole or not at all
      for path in shipped.iterdir():
        if path.is_file():
          shutil.copy(path, tmp / path.name)
    print(f"early head: training over the heads shipped in {shipped} (copied to {folder})")
  return folder


def train_early_head(model, train_rows, held_rows, out: Path, layer: int, top_k: int, epochs: int, batch: int,
                     lr: float) -> dict:
  """ProPD's early head on a frozen base: CE of the next token over the draft vocabulary, from the logit lens."""
  import jax
  import jax.numpy as jnp
  import optax

  from pasta_jax.decode.rules import pruning
  heads, _, _ = medusa.load_heads(out / "heads")
  unembed = model.params["params"]["embedder"]
  drafted, vocab = medusa.draft_unembed(heads, unembed), heads.get("vocab")
  states, targets = early_states(model, train_rows, layer)
  held_states, held_targets = early_states(model, held_rows, layer)
  remap = np.full(unembed.shape[0], -1, np.int64)
  remap[np.asarray(vocab) if vocab is not None else np.arange(unembed.shape[0])] = np.arange(drafted.shape[0])
  rows = remap[targets]
  states, rows = states[rows >= 0], rows[rows >= 0]  # a target outside the draft vocabulary is never a candidate
  head = pruning.logit_lens_head(model.params["params"]["final_norm"]["scale"])
  before = early_hit_rate(head, held_states, held_targets, drafted, vocab, top_k)
  steps = epochs * (len(states) // batch)
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps), weight_decay=0.0)
  opt_state = optimizer.init(head)

  def loss_fn(head, x, t):
    log_p = jax.nn.log_softmax(pruning.early_head_logits(head, x, drafted), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_p, t[:, None], axis=-1))

  @jax.jit
  def update(head, opt_state, x, t):
    loss, grads = jax.value_and_grad(loss_fn)(head, x, t)
    updates, opt_state = optimizer.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, loss

  rng, history = np.random.default_rng(0), []
  with tqdm(total=steps, desc=f"train early head (layer {layer})") as bar:
    for _ in range(epochs):
      order = rng.permutation(len(states))
      for i in range(len(states) // batch):
        pick = order[i * batch:(i + 1) * batch]
        head, opt_state, loss = update(head, opt_state, jnp.asarray(states[pick]), jnp.asarray(rows[pick]))
        history.append(float(loss))
        bar.set_postfix(loss=f"{float(loss):.3f}")
        bar.update()
  after = early_hit_rate(head, held_states, held_targets, drafted, vocab, top_k)
  meta = {"layer": layer, "top_k": top_k, "positions": int(len(states)), "steps": steps, "epochs": epochs,
          "lr": lr, "first_loss": history[0] if history else None, "last_loss": history[-1] if history else None,
          "held_out_top_k_hit_rate": {"logit_lens": before, "trained": after}}
  _save_early_head(out / "heads", head, meta)
  runfiles.write_json(out / "early_loss.json", history, indent=None)
  return meta


def _save_early_head(folder: Path, head, meta: dict) -> None:
  """`pruning.save_early_head` into `folder` file by file, each renamed in whole (the stage reruns whole, so
  a kill between them is followed by both being written again)."""
  from pasta_jax.decode.rules import pruning
  with tempfile.TemporaryDirectory(dir=folder, prefix=".early-") as scratch:
    pruning.save_early_head(scratch, head, meta)
    for name in (pruning.EARLY_WEIGHTS, pruning.EARLY_CONFIG):  # the config (what loading looks for) last
      runfiles.write_atomic(folder / name, (Path(scratch) / name).read_bytes())
