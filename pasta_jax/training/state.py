"""The train state (step, master params, optimizer state) and where each of its arrays lives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pasta_jax.model.partitioning import param_specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  step: jax.Array  # [] int32: optimizer steps taken
  params: dict
  opt_state: optax.OptState


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def state_shardings(abstract_state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """NamedSharding per leaf: params by the logical-axis rules; Adam moments exactly like their params;
  scalars (step, counts) replicated."""
  specs = param_specs(abstract_state.params, dict(mesh.shape))
  named = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  replicated = NamedSharding(mesh, PartitionSpec())
  opt = optax.tree_map_params(optimizer, lambda _, s: s, abstract_state.opt_state, named,
                              transform_non_params=lambda _: replicated)
  return TrainState(replicated, named, opt)


def create_sharded_state(params, optimizer: optax.GradientTransformation, mesh: Mesh) -> tuple[TrainState, TrainState]:
  """(state placed on the mesh, its shardings). The optimizer state is created already sharded."""
  abstract = jax.eval_shape(lambda p: init_state(p, optimizer), params)
  shardings = state_shardings(abstract, optimizer, mesh)
  params = jax.device_put(params, shardings.params)
  state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=shardings)(params)
  return state, shardings
