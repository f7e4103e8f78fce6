"""optax AdamW with the paper's schedule: linear decay from the peak learning rate to the end rate."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from pasta_jax.training.config import TrainConfig


def learning_rate_schedule(config: TrainConfig, total_steps: int) -> optax.Schedule:
  """Optional linear warm-up, then linear decay lr -> end_lr over the remaining steps (paper: 1e-5 -> 0)."""
  decay_steps = max(total_steps - config.warmup_steps, 1)
  decay = optax.linear_schedule(config.learning_rate, config.end_learning_rate, decay_steps)
  if config.warmup_steps <= 0:
    return decay
  warmup = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
  return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: TrainConfig, total_steps: int) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(config, total_steps)
  adamw = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, weight_decay=config.weight_decay,
                      mu_dtype=jnp.dtype(config.mu_dtype))
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw
