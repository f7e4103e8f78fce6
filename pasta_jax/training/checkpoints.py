"""Orbax checkpoints of the train state, with resume.

Each saved step holds the whole TrainState (sharded arrays are written and restored in place by
every host) and a JSON record of the model config and the training config. Resuming under another
model, or under a training config that changes what is trained (any field but `RUN_ONLY_FIELDS`), is
refused by comparing that record, before Orbax touches any array. Orbax writes each step under a
temporary name and renames it when whole, so a step cut off by a kill is never the one restored.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from pasta_jax.errors import ConfigError
from pasta_jax.model import runfiles
from pasta_jax.model.checkpoint import describe_difference
from pasta_jax.model.config import GemmaConfig, config_from_dict, config_to_dict
from pasta_jax.paths import run_path
from pasta_jax.training.config import RUN_ONLY_FIELDS, TrainConfig
from pasta_jax.training.state import TrainState


def abstract_with_shardings(state_shapes: TrainState, shardings: TrainState) -> TrainState:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_shapes, shardings)


class TrainCheckpoints:
  """Save every `save_every` steps, keep the newest `keep`, restore the latest."""

  def __init__(self, directory: str | os.PathLike, model_config: GemmaConfig, train_config: TrainConfig):
    self.directory = run_path(directory)  # local (absolute) or gs://
    self.model_config = model_config
    self.train_config = train_config
    options = ocp.CheckpointManagerOptions(max_to_keep=train_config.keep_checkpoints, create=True,
                                           enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _meta(self) -> dict[str, Any]:
    return {"model": config_to_dict(self.model_config), "train": self.train_config.to_dict()}

  def save(self, step: int, state: TrainState, force: bool = False) -> bool:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(self._meta()))
    saved = self.manager.save(step, args=args, force=force)
    runfiles.kill_point("checkpoint")  # tests: a kill while the asynchronous save is still writing
    return saved

  def check_compatible(self, step: int) -> None:
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = config_from_dict(meta["model"])
    if dataclasses.replace(saved, name="") != dataclasses.replace(self.model_config, name=""):
      raise ConfigError(f"checkpoint {self.directory}/{step} is from another model ("
                        f"{describe_difference(saved, self.model_config)}); use a fresh --out directory")
    runfiles.check_settings(meta.get("train", {}), self.train_config.to_dict(),
                            f"checkpoint {self.directory}/{step}", ignore=RUN_ONLY_FIELDS,
                            defaults=TrainConfig().to_dict(), error=ConfigError)

  def restore(self, step: int, state_shapes: TrainState, shardings: TrainState) -> TrainState:
    self.check_compatible(step)
    target = abstract_with_shardings(state_shapes, shardings)
    restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return restored["state"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
