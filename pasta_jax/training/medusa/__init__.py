"""Medusa-1 heads and ProPD's early head for a frozen pasta_jax Gemma (paper 004's drafter), stage by stage:

  distill  the model's own greedy answers to training-pool prompts, as token-id rows (distill.py), which
           every later stage reads, split into training and held-out rows;
  heads    the heads trained on the frozen base's cached hidden states, and calibrated: per-head top-k hit
           rates on held-out rows (heads.py);
  early    ProPD's early prediction head, from the logit lens, over the heads' draft vocabulary (early.py).

`python -m train.medusa` runs them in order, each resumable.
"""
