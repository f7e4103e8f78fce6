"""Medusa training (pasta_jax.training.medusa) on a tiny model: heads, calibration and ProPD's early head, then
decoding with them.

Oracles: the logit lens (the early head's start, which training must beat on held-out answers) and plain
greedy decoding (ProPD with the trained early head, pruning by default, must write the same tokens).
"""

from __future__ import annotations

import json

import numpy as np

from pasta_jax.decode.speculation import load_drafter
from pasta_jax.methods import Propd, Sequential, generate_ids
from pasta_jax.model import medusa
from pasta_jax.training.medusa import distill, early, heads
from tests.test_medusa import assert_same_greedy
from tests.tiny import tiny_model

MODEL = tiny_model()
PROMPTS = [[2] + [int(t) for t in np.random.default_rng(i).integers(5, 60, size=3 + i % 4)] for i in range(12)]


def test_heads_calibration_and_early_head_train_and_drive_propd(tmp_path):
  # Answers that count up (t -> t + 1): a map the early head can learn and the logit lens, which ranks the
  # token itself first on a tied-embedding model, cannot.
  rows = [{"prompt_ids": p, "answer_ids": [5 + (p[-1] + k) % 50 for k in range(24)]} for p in PROMPTS]
  train_rows, held_rows = distill.split(rows, 0.25)
  # wide next_token heads: the training positions' next tokens, their features and the rules' path, end to end
  heads.train_heads(MODEL, train_rows, tmp_path, medusa.MedusaConfig(num_heads=2, next_token=True, width=16),
                    epochs=30, batch=32, lr=1e-2, vocab_size=0)
  info = heads.calibrate(MODEL, held_rows, tmp_path, top_k=4)
  assert info["top1"][0] > 0.5, info  # t + 2 follows from t + 1 in these answers
  folder = early.heads_folder(MODEL, tmp_path)  # this run's heads: nothing copied
  meta = early.train_early_head(MODEL, train_rows, held_rows, tmp_path, layer=1, top_k=1, epochs=30,
                                batch=32, lr=1e-2)
  rates = meta["held_out_top_k_hit_rate"]
  assert rates["trained"] > rates["logit_lens"] + 0.1, rates
  assert json.loads((folder / "early.json").read_text())["layer"] == 1
  drafter = load_drafter(MODEL, folder)
  assert drafter.early_layer == 1 and set(drafter.early_head) == {"norm", "w", "b"}
  answers = generate_ids(MODEL, PROMPTS[:3], Sequential(), max_new_tokens=24)
  runs = generate_ids(MODEL, PROMPTS[:3], Propd(heads=drafter, tree_size=8, latency=(1e-06, 1.0)), max_new_tokens=24)
  assert_same_greedy(answers, runs)
  assert max(r.speculation["prune_rate"] for r in runs) > 0  # the trained head pruned by default
