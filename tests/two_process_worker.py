"""One of two real JAX processes joined on 127.0.0.1 (CPU collectives over gloo), one CPU device each, for
tests/test_two_processes.py: trains the tiny model one step on a mesh over both processes, resumes from the Orbax
checkpoint they wrote for a second step and the export, and decodes on a mesh over both; or (`adapter`) trains a
LoRA adapter one step on a tensor axis that spans both, each process feeding the whole batch, and exports it. Writes
what it saw to OUT_DIR/process-<id>.json. The test runs the same functions in its own process on one device.

  python -m tests.two_process_worker PROCESS_ID PORT OUT_DIR [adapter]
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np

from pasta_jax.decode.runtime import Runtime
from pasta_jax.errors import ConfigError
from pasta_jax.methods import Pasta, Sequential, generate
from pasta_jax.model import lora
from pasta_jax.model.mesh import MeshConfig, make_mesh
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.distributed import batch_slice
from pasta_jax.training.trainer import Trainer
from tests import training_data
from tests.tiny import tiny_model

PROCESSES = 2
# One device per process (the cheapest mesh over both). Training's fsdp splits the batch and every weight across the
# processes (each writes its own shards of the checkpoint); decoding's data splits the requests and their pool.
TRAIN_MESH = MeshConfig(fsdp=2)
DECODE_MESH = MeshConfig(data=2)
ADAPTER_MESH = MeshConfig(tensor=2)  # the batch whole on both processes (replicas), adapter factors split
ONE_DEVICE = MeshConfig()
STEPS = 2
PROMPTS = ["q", "tips?"]
# two threads forked, joined and main going on, in 10 steps: each step of a loop whose requests are split across
# processes costs tens of small cross-process collectives
PASTA = 'A<promise topic="a" tokens="10"/><async>b</async><promise topic="b" tokens="10"/><async>c</async><sync/>d'


def start(process_id: int, port: int) -> None:
  """Joins the other process, before any computation. Short timeouts: a peer that died ends this one within
  seconds, not after JAX's default minutes."""
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_default_matmul_precision", "highest")  # as the test's own process (tests/conftest.py)
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=PROCESSES,
                             process_id=process_id, initialization_timeout=60, heartbeat_timeout_seconds=10,
                             shutdown_timeout_seconds=10)
  assert jax.process_count() == PROCESSES and jax.device_count() == PROCESSES, jax.devices()


def trainer(out_dir: str, mesh: MeshConfig, devices=None, host_slice: bool = True, adapter: bool = False) -> Trainer:
  """The tiny model's two-step trainer (adapter: a one-step LoRA run); each process feeds its slice of every global
  batch (`batch_slice`), or, with host_slice False, the whole batch."""
  model = tiny_model()
  config = TrainConfig(model="tiny", mesh=mesh, batch_size=8, grad_accum=2, seq_len=112, num_threads=4,
                       learning_rate=1e-3, save_every=1000, max_steps=STEPS)
  if adapter:
    config = config.replace(max_steps=1, learning_rate=1e-2, lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS)
  index, count = batch_slice(make_mesh(mesh, devices)) if host_slice else (0, 1)
  share = config.batch_size // count
  data = [jax.tree.map(lambda x: x[index * share:(index + 1) * share], batch)
          for batch in training_data.batches(model.tokenizer, batch_size=config.batch_size)]
  made = Trainer(config, model, data, out_dir, devices=devices, check_memory=False, progress=False)
  made._mfu = lambda tokens, seconds: 0.0
  return made


def train(out_dir: str, mesh: MeshConfig, devices=None, resume: bool = True) -> dict:
  """Both steps and the export by one trainer; with `resume`, by two: the first stops after step 1 (a checkpoint),
  a fresh one resumes from it."""
  if not resume:
    done = trainer(out_dir, mesh, devices).run()
    return {"losses": done.losses, "model_dir": str(done.model_dir), "resumed_from": None}
  first = trainer(out_dir, mesh, devices).run(stop_after=1)
  resumed = trainer(out_dir, mesh, devices)
  second = resumed.run()
  return {"losses": first.losses + second.losses, "model_dir": str(second.model_dir),
          "resumed_from": resumed.resumed_from}


def train_adapter(out_dir: str, mesh: MeshConfig, devices=None) -> dict:
  done = trainer(out_dir, mesh, devices, adapter=True).run()
  return {"losses": done.losses, "model_dir": str(done.model_dir)}


def decode(mesh) -> dict:
  """Per case, per prompt: records, flags, thread traces and logits, on `mesh` (None: one device)."""
  model = tiny_model()
  kw = dict(runtime=Runtime(mesh=mesh), max_new_tokens=8, return_logits=True)
  cases = {"sequential-greedy": lambda: generate(model, PROMPTS, Sequential(), **kw),
           "pasta-forced": lambda: generate(model, PROMPTS, Pasta(lanes=4), forced_answers=[PASTA] * 2, **kw)}
  return {name: [{"records": r.records.tolist(), "flags": [r.finished, r.truncated, r.pool_full, r.budget_spent],
                  "traces": [[t.thread, t.lane, t.spawn_step, t.finish_step, t.tokens] for t in r.threads],
                  "logits": np.asarray(r.logits).tolist()} for r in run()] for name, run in cases.items()}


def refusal(out_dir: str) -> str:
  """What the trainer says when every process feeds the whole global batch on a mesh that splits it."""
  try:
    trainer(out_dir, TRAIN_MESH, host_slice=False)
  except ConfigError as err:
    return str(err)
  return ""


def run_all(out_dir: str) -> dict:
  """Batch slices, the refusal, training with its resume, decoding; and this process's CPU seconds by part."""
  laps = {"until_start": time.process_time()}
  slices = {name: batch_slice(mesh) for name, mesh in
            (("fsdp2", TRAIN_MESH), ("data2", DECODE_MESH), ("tensor2", ADAPTER_MESH))}
  report = {"batch_slices": slices, "refusal": refusal(f"{out_dir}/refused")}
  laps["model_and_checks"] = time.process_time() - sum(laps.values())
  report["train"] = train(f"{out_dir}/train", TRAIN_MESH)
  laps["train"] = time.process_time() - sum(laps.values())
  report["decode"] = decode(make_mesh(DECODE_MESH))
  laps["decode"] = time.process_time() - sum(laps.values())
  return {**report, "cpu_s": laps}


def main(process_id: int, port: int, out_dir: str, mode: str = "all") -> None:
  start(process_id, port)
  if mode == "adapter":
    report = {"batch_slice": batch_slice(ADAPTER_MESH), "train": train_adapter(f"{out_dir}/adapter", ADAPTER_MESH)}
  else:
    report = run_all(out_dir)
  with open(f"{out_dir}/process-{process_id}.json", "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
