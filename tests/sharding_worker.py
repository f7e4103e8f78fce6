"""Run in a fresh process: one train two train steps on 1 device and on 8 simulated CPU devices (data=2, fsdp=2,
tensor=2); prints JSON with both losses and the largest parameter difference.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding_worker OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pasta_jax.model.mesh import MeshConfig  # noqa: E402
from pasta_jax.training.config import TrainConfig  # noqa: E402
from pasta_jax.training.metrics_log import read_metrics  # noqa: E402
from pasta_jax.training.trainer import Trainer  # noqa: E402
from tests import training_data  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402


def one_step(mesh: MeshConfig, devices, out_dir: str):
  model = tiny_model()
  data = training_data.batches(model.tokenizer, batch_size=8)
  config = TrainConfig(model="tiny", mesh=mesh, batch_size=8, grad_accum=2, seq_len=112, num_threads=4,
                       learning_rate=1e-3, save_every=1000)
  trainer = Trainer(config, model, data, out_dir, devices=devices, check_memory=False, progress=False)
  trainer._mfu = lambda tokens, seconds: 0.0
  result = trainer.run(stop_after=2)
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), trainer.state.params)
  specs = {jax.tree_util.keystr(k): str(v.sharding.spec)
           for k, v in jax.tree_util.tree_leaves_with_path(trainer.state.params)}
  grad_norms = [row["grad_norm"] for row in read_metrics(out_dir)]
  return result.losses, grad_norms, params, specs


def main(out_dir: str) -> None:
  devices = jax.devices()
  assert len(devices) == 8, devices
  loss_1, norms_1, params_1, _ = one_step(MeshConfig(), devices[:1], f"{out_dir}/one")
  loss_8, norms_8, params_8, specs = one_step(MeshConfig(data=2, fsdp=2, tensor=2), devices, f"{out_dir}/eight")
  diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_8))])
  print(json.dumps({"loss_1": loss_1, "loss_8": loss_8, "grad_norm_1": norms_1, "grad_norm_8": norms_8,
                    "max_param_diff": float(diffs.max()), "share_over_1e-6": float(np.mean(diffs > 1e-6)),
                    "specs": specs}))


if __name__ == "__main__":
  main(sys.argv[1])
