"""Medusa-1 heads for a pasta_jax Gemma, as one resumable command (paper 004's drafter, Medusa-1 recipe).

  python -m train.medusa --out runs/medusa270m

Stages, each resumable (a finished stage is skipped; `distill` appends and resumes per batch):
  distill  self-distillation data: the model's own greedy answers to training-pool prompts (Medusa-2's advice
           for models whose training data is not at hand), written as token ids to distill.jsonl;
  train    the heads on a frozen base: loss sum_k 0.8^k CE(head_k) (`pasta_jax.model.medusa`), the base's
           hidden states computed once and cached; heads.safetensors + heads.json at the end (--next-token:
           heads that also read the token at t + 1, the tree's root);
  calibrate  per-head top-k hit rates on held-out distilled answers (calibration.json): the tree builder's
           and ProPD's prior;
  early    ProPD's early prediction head (`decode/rules/pruning.py`): the residual stream after --early-layer
           layers -> the next token, over the heads' draft vocabulary, from the logit lens as its start;
           heads/early.safetensors + early.json with the held-out top-K hit rates before and after (over
           this run's heads, or a copy of the model's shipped ones).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pasta_jax.data.sources import read_records
from pasta_jax.errors import PastaError
from pasta_jax.model import medusa

POOLS = ("lima", "alpaca_gpt4_1k", "alpaca_5k")  # training pools; alpaca_eval_805 stays held out


def prompts_from_pools(count: int) -> list[str]:
  """The first `count` distinct instructions, taken round-robin from the training pools."""
  per_pool = [read_records(p) for p in POOLS]
  out, seen = [], set()
  for i in range(max(len(r) for r in per_pool)):
    for records in per_pool:
      if i < len(records):
        text = records[i]["instruction"] + (("\n\n" + records[i]["input"]) if records[i].get("input") else "")
        if text not in seen:
          seen.add(text)
          out.append(text)
      if len(out) == count:
        return out
  return out


def answer_ids(result, eos_ids) -> list[int]:
  """The answer's token ids, up to (not including) its end id."""
  out = []
  for token in result.records[:, 3].tolist():
    if token in eos_ids:
      break
    out.append(int(token))
  return out


def distill(model, out: Path, count: int, batch: int, new_tokens: int) -> Path:
  """Greedy answers of `model` to `count` pool prompts, appended per batch to distill.jsonl (resumes)."""
  from pasta_jax.decode.api import generate_ids, prompt_ids
  path = out / "distill.jsonl"
  done = sum(1 for _ in path.open()) if path.exists() else 0
  prompts = prompts_from_pools(count)
  eos = set(model.tokenizer.eos_ids) if hasattr(model.tokenizer, "eos_ids") else None
  with path.open("a") as sink, tqdm(total=len(prompts), initial=done, desc="distill (greedy answers)") as bar:
    for start in range(done, len(prompts), batch):
      texts = prompts[start:start + batch]
      ids = prompt_ids(model.tokenizer, texts, chat=True)
      # the certified head: float32 greedy's tokens at the narrow head's cost (decode/certified_head.py)
      results = generate_ids(model, ids, method="sequential", lanes=1, max_threads=1, max_new_tokens=new_tokens,
                             certify_head=True)
      for text, prompt, result in zip(texts, ids, results):
        ends = eos if eos is not None else set()
        sink.write(json.dumps({"prompt": text, "prompt_ids": prompt, "answer_ids": answer_ids(result, ends),
                               "finished": result.finished}) + "\n")
      sink.flush()
      bar.update(len(texts))
  return path


# --- train ---------------------------------------------------------------------------------------------
def read_distilled(path: Path) -> list[dict]:
  rows = [json.loads(line) for line in path.open()]
  return [r for r in rows if len(r["answer_ids"]) >= 4]


def split(rows: list[dict], held_out: float) -> tuple[list[dict], list[dict]]:
  """A fixed split: every k-th row is held out for calibration (k = 1 / held_out)."""
  every = max(2, round(1 / held_out))
  return [r for i, r in enumerate(rows) if i % every], [r for i, r in enumerate(rows) if i % every == 0]


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
    np.savez(cache, states=states, targets=targets, next_tokens=next_tokens, key=key)
  return states, targets, next_tokens


def padded_batches(rows: list[dict], batch: int, desc: str):
  """Yields (rows, their prompt + answer ids, tokens [b, bucketed L] zero-padded, lengths) per `batch` rows."""
  from pasta_jax.decode.loop import bucket
  for start in tqdm(range(0, len(rows), batch), desc=desc):
    chunk = rows[start:start + batch]
    seqs = [np.asarray(r["prompt_ids"] + r["answer_ids"]) for r in chunk]
    tokens = np.zeros((len(seqs), bucket(max(map(len, seqs)))), np.int32)
    for i, seq in enumerate(seqs):
      tokens[i, :len(seq)] = seq
    yield chunk, seqs, tokens, [len(q) for q in seqs]


def compute_hidden(model, rows: list[dict], num_heads: int, batch: int = 4
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  import jax
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma, causal_mask
  module = Gemma(model.config)

  @jax.jit
  def hidden(tokens, lengths):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return module.apply(model.params, tokens, positions, causal_mask(*tokens.shape, lengths), hidden_only=True)

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
  np.save(cache, vocab)
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
  medusa.save_heads(out / "heads", heads, config, meta)
  (out / "train_loss.json").write_text(json.dumps(history))
  return meta


def calibrate(model, rows: list[dict], out: Path, top_k: int) -> dict:
  """Per-head top-k hit rates on held-out distilled answers: P(head h's rank-r token is the target)."""
  import jax
  import jax.numpy as jnp
  heads, config, _ = medusa.load_heads(out / "heads")
  states, targets, next_tokens = hidden_and_targets(model, rows, config.num_heads, out / "hidden_held_out.npz")
  unembed = model.params["params"]["embedder"]
  drafted = medusa.draft_unembed(heads, unembed)

  @jax.jit
  def top(h, nxt, embedding):
    next_embed = medusa.next_features(embedding, nxt) if config.next_token else None
    return medusa.head_top_tokens(heads, h, drafted, top_k, model.config.final_logit_softcap, next_embed)

  hits = np.zeros((config.num_heads, top_k))
  counts = np.zeros((config.num_heads,))
  for start in range(0, len(states), 256):
    ranks = np.asarray(top(jnp.asarray(states[start:start + 256]), jnp.asarray(next_tokens[start:start + 256]),
                           unembed))  # [m, H, k]
    t = targets[start:start + 256]
    hits += ((ranks == t[:, :, None]) & (t[:, :, None] >= 0)).sum(axis=0)
    counts += (t >= 0).sum(axis=0)
  rates = hits / np.maximum(counts, 1)[:, None]
  info = {"hit_rates": rates.tolist(), "top1": rates[:, 0].tolist(), "topk": rates.sum(axis=1).tolist(),
          "positions": int(len(states)), "prompts": len(rows)}
  (out / "heads" / "calibration.json").write_text(json.dumps(info, indent=1))
  return info


# --- early head (ProPD) ----------------------------------------------------------------------------------
def early_states(model, rows: list[dict], layer: int, batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """The residual stream after `layer` layers at every answer position t - 1 ([M, D]) and the next token [M]."""
  import jax
  import jax.numpy as jnp

  from pasta_jax.model.gemma import Gemma, causal_mask
  module = Gemma(model.config)
  stream = jax.jit(lambda tokens, lengths: module.apply(
      model.params, tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
      causal_mask(*tokens.shape, lengths), hidden_after=layer))
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
  if not (folder / medusa.WEIGHTS_FILE).exists():
    shipped = Path(load_drafter(model).source)
    folder.mkdir(parents=True, exist_ok=True)
    for path in shipped.iterdir():
      if path.is_file():
        shutil.copy(path, folder / path.name)
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
  pruning.save_early_head(out / "heads", head, meta)
  (out / "early_loss.json").write_text(json.dumps(history))
  return meta


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="run directory")
  parser.add_argument("--model", default=None, help="model to train heads for (default: the tuned default)")
  parser.add_argument("--stages", default="distill,train,calibrate")
  parser.add_argument("--prompts", type=int, default=256, help="distillation prompts")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4, help="Medusa heads K")
  parser.add_argument("--next-token", action="store_true",
                      help="heads that also read the token at t + 1, the tree's root (model/medusa.py)")
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--train-batch", type=int, default=128, help="positions per step")
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--draft-vocab", type=int, default=16384,
                      help="tokens the heads rank: the most frequent of the training text (0: all 262k)")
  parser.add_argument("--top-k", type=int, default=10, help="candidates per head kept at calibration")
  parser.add_argument("--held-out", type=float, default=0.1, help="share of distilled answers kept for calibration")
  parser.add_argument("--early-layer", type=int, default=4, help="stage early: the layer ProPD's early head reads")
  parser.add_argument("--early-top-k", type=int, default=50, help="stage early: the list pruning keeps per node")
  args = parser.parse_args(argv)
  from pasta_jax.model.load import load_model
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  model = load_model(args.model)
  stages = [s.strip() for s in args.stages.split(",") if s.strip()]
  try:
    if "distill" in stages:
      distill(model, out, args.prompts, args.batch, args.new_tokens)
    train_rows, held_rows = split(read_distilled(out / "distill.jsonl"), args.held_out)
    if "train" in stages and not (out / "heads" / medusa.WEIGHTS_FILE).exists():
      config = medusa.MedusaConfig(num_heads=args.heads, next_token=args.next_token)
      meta = train_heads(model, train_rows, out, config, args.epochs,
                         args.train_batch, args.lr, args.draft_vocab)
      print(f"heads: {meta['steps']} steps, loss {meta['first_loss'][0]:.3f} -> {meta['last_loss'][0]:.3f}")
    if "calibrate" in stages:
      info = calibrate(model, held_rows, out, args.top_k)
      print("top-1 hit rate per head:", " ".join(f"{x:.3f}" for x in info["top1"]))
    if "early" in stages:
      heads_folder(model, out)
      meta = train_early_head(model, train_rows, held_rows, out, args.early_layer, args.early_top_k, args.epochs,
                              args.train_batch, args.lr)
      rates = meta["held_out_top_k_hit_rate"]
      print(f"early head, layer {args.early_layer}: next token in the top {args.early_top_k} "
            f"{rates['logit_lens']:.3f} (logit lens) -> {rates['trained']:.3f} (trained)")
  except PastaError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
