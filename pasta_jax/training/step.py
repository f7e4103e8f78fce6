"""The jitted train step: gradient accumulation over micro-batches, then one optimizer update.

Every objective is a `LossFn(params, micro_batch) -> (numerator, denominator, aux)`; the step sums
numerators and their gradients over the micro-batches and divides by the summed denominator, so
the update equals one pass over the whole global batch (SFT: token-weighted NLL; BoNBoN: mean over
pairs), whatever grad_accum or the mesh. The state is donated: params and moments are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pasta_jax.model import lora
from pasta_jax.model.partitioning import RULES
from pasta_jax.training.state import TrainState

LossFn = Callable[..., tuple[jax.Array, jax.Array, dict]]  # (params, micro_batch, *loss_args)


def split_micro_batches(batch, grad_accum: int):
  """Host batch with leading [B] -> [grad_accum, B / grad_accum] (numpy, before placement)."""

  def split(x):
    x = np.asarray(x)
    if x.shape[0] % grad_accum:
      raise ValueError(f"batch of {x.shape[0]} does not split into {grad_accum} micro-batches")
    return x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:])

  return jax.tree.map(split, batch)


def micro_batch_shardings(mesh: Mesh, batch) -> object:
  """[A, B, ...] leaves: the example axis B over data x fsdp, everything else replicated."""
  return jax.tree.map(lambda x: NamedSharding(mesh, PartitionSpec(None, RULES["batch"], *([None] * (x.ndim - 2)))),
                      batch)


def place_batch(host_batch, mesh: Mesh, grad_accum: int):
  """This host's slice of the global batch -> global sharded arrays [A, B, ...] (multi-host safe)."""
  micro = split_micro_batches(host_batch, grad_accum)
  shardings = micro_batch_shardings(mesh, micro)
  return jax.tree.map(jax.make_array_from_process_local_data, shardings, micro)


def _accumulate(loss_fn: LossFn, params, micro_batches, frozen=None, loss_args=()):
  """Sums (grads of numerator, numerator, denominator) over the leading micro-batch axis.

  With `frozen` (an adapter run), the loss sees the frozen base merged with `params`, and gradients
  are taken with respect to `params` (the adapter) only. `loss_args`: further frozen trees the loss takes
  after the micro-batch (a KL reference adapter).
  """
  combine = (lambda p: p) if frozen is None else (lambda p: lora.merge(frozen, p))
  grad_fn = jax.value_and_grad(lambda p, mb: _split_aux(loss_fn(combine(p), mb, *loss_args)), has_aux=True)

  def body(carry, micro_batch):
    grads_sum, num_sum, den_sum = carry
    (num, (den, aux)), grads = grad_fn(params, micro_batch)
    grads_sum = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_sum, grads)
    return (grads_sum, num_sum + num, den_sum + den), aux

  zeros = jax.tree.map(jnp.zeros_like, params)
  init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
  (grads, num, den), aux = jax.lax.scan(body, init, micro_batches)
  return grads, num, den, jax.tree.map(jnp.mean, aux)


def _split_aux(out):
  num, den, aux = out
  return num, (den, aux)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    state_shardings: TrainState, batch_shardings, frozen_shardings=None,
                    loss_arg_shardings: tuple = ()) -> Callable:
  """jit(step)(state, batch [A, B, ...][, frozen, *loss_args]) -> (state, metrics); the state buffers are donated.

  frozen_shardings: an adapter run's frozen base params; loss_arg_shardings: the frozen trees the loss takes
  after the micro-batch (arguments, never baked-in constants).
  """

  def step(state: TrainState, batch, frozen=None, *loss_args):
    grads, num, den, aux = _accumulate(loss_fn, state.params, batch, frozen, loss_args)
    den = jnp.maximum(den, 1.0)
    grads = jax.tree.map(lambda g: g / den.astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": num / den, "grad_norm": optax.tree.norm(grads), "loss_tokens": den,
               "learning_rate": schedule(state.step), **aux}
    return TrainState(state.step + 1, params, opt_state), metrics

  in_shardings = (state_shardings, batch_shardings)
  if frozen_shardings is not None:
    in_shardings += (frozen_shardings, *loss_arg_shardings)
  return jax.jit(step, in_shardings=in_shardings, out_shardings=(state_shardings, None), donate_argnums=0)
