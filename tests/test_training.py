"""The trainer: exact sharding, a killed run resumes losing nothing, exact accumulation, bad configs refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from pasta_jax.errors import ConfigError
from pasta_jax.model.mesh import MeshConfig, make_mesh, parse_mesh
from pasta_jax.model.partitioning import param_specs
from pasta_jax.training.config import TrainConfig, load_train_config
from pasta_jax.training.metrics_log import read_metrics
from pasta_jax.training.trainer import Trainer
from tests import train_worker, training_data
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=600)


def test_eight_simulated_devices_match_one_device(tmp_path):
  out = _run_module("tests.sharding_worker", str(tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  np.testing.assert_allclose(got["loss_8"], got["loss_1"], rtol=1e-5)
  np.testing.assert_allclose(got["grad_norm_8"], got["grad_norm_1"], rtol=1e-5)
  # Adam's first update is ~lr * sign(g): a gradient within rounding of 0 may flip sign, nothing else may differ.
  assert got["share_over_1e-6"] < 1e-3, got
  assert got["max_param_diff"] < 2e-3, got
  # the 8-device run really was sharded over all three axes
  specs = " ".join(got["specs"].values())
  assert "'tensor'" in specs and "'fsdp'" in specs


def test_killed_run_resumes_with_identical_losses(tmp_path):
  killed = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, "-m", "tests.train_worker", str(killed), "400"], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 300
  while len(read_metrics(killed)) < 5:
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert time.time() < deadline, "the worker never reached step 5"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)  # no clean shutdown: whatever was not checkpointed is lost
  proc.wait()
  resumed = train_worker.make_trainer(str(killed), 400)
  start = resumed.resumed_from
  assert start is not None and start >= 2 and start % 2 == 0
  after = resumed.run(stop_after=start + 3).losses
  reference = train_worker.make_trainer(str(tmp_path / "straight"), 400).run(stop_after=start + 3).losses
  assert after == reference[start:]  # bit-identical
  logged = [row["step"] for row in read_metrics(killed)]
  assert logged == list(range(start + 3))  # the killed run's unsaved steps were dropped, not duplicated


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
  model = tiny_model()
  data = training_data.batches(model.tokenizer, batch_size=4)
  losses, params = [], []
  for accum in (1, 2, 4):
    config = TrainConfig(model="tiny", batch_size=4, grad_accum=accum, seq_len=112, num_threads=4,
                         learning_rate=1e-3, grad_clip=0.0)
    trainer = Trainer(config, model, data, tmp_path / str(accum), check_memory=False, progress=False)
    trainer._mfu = lambda tokens, seconds: 0.0
    losses.append(trainer.run(stop_after=1).losses[0])
    params.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(trainer.state.params)]))
  np.testing.assert_allclose(losses[1:], [losses[0]] * 2, rtol=1e-6)
  for other in params[1:]:
    assert np.mean(np.abs(other - params[0]) > 1e-6) < 1e-3


def test_batches_padded_to_their_own_bucket_train_as_padded_to_seq_len(tmp_path):
  """Length grouping pads each batch only to its bucket: the trainer (a program per padded length) must train as
  on the same examples padded to seq_len."""
  from pasta_jax.data.encode import encode_example
  from pasta_jax.data.pipeline import compact_layout
  from pasta_jax.lang.layout import stack_layouts
  model = tiny_model()
  records = training_data.records(12)
  records[4]["annotated"] += " more"  # the second batch longer than the first
  layouts = [encode_example(r, model.tokenizer, model.tokenizer.tag_vocab(), training_data.ENCODE) for r in records]
  groups = [[compact_layout(x) for x in layouts[i:i + 4]] for i in (0, 4, 8)]
  buckets = [-(-max(x.length for x in group) // 8) * 8 for group in groups]
  assert len(set(buckets)) > 1 and max(buckets) < training_data.ENCODE.seq_len
  padded = {"seq_len": [stack_layouts(layouts[i:i + 4]) for i in (0, 4, 8)],
            "bucket": [stack_layouts(group, length=b, num_threads=4) for group, b in zip(groups, buckets)]}
  config = TrainConfig(model="tiny", batch_size=4, seq_len=112, num_threads=4, learning_rate=1e-3)
  losses, params = {}, {}
  for name, data in padded.items():
    trainer = Trainer(config, model, data, tmp_path / name, check_memory=False, progress=False)
    trainer._mfu = lambda tokens, seconds: 0.0
    losses[name] = trainer.run(stop_after=3).losses
    params[name] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(trainer.state.params)])
  np.testing.assert_allclose(losses["bucket"], losses["seq_len"], rtol=1e-5)
  np.testing.assert_allclose(params["bucket"], params["seq_len"], atol=1e-5)


def test_checkpoint_from_another_model_is_refused(tmp_path):
  train_worker.make_trainer(str(tmp_path), 4).run(stop_after=2)
  other = tiny_model("tiny-gemma2")
  data = training_data.batches(other.tokenizer)
  with pytest.raises(ConfigError, match="another model"):
    Trainer(train_worker.CONFIG, other, data, tmp_path, check_memory=False, progress=False)


def test_loss_goes_down_and_export_loads(tmp_path):
  from pasta_jax.model.load import load_model
  trainer = train_worker.make_trainer(str(tmp_path), 12)
  result = trainer.run()
  assert result.losses[-1] < 0.5 * result.losses[0]
  loaded = load_model(result.model_dir, with_tokenizer=False)
  assert loaded.config == trainer.model.config
  saved = np.concatenate([np.ravel(x) for x in jax.tree.leaves(loaded.params)])
  trained = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(trainer.state.params)])
  np.testing.assert_array_equal(saved, trained)


@pytest.mark.parametrize("fields, message", [
    (dict(batch_size=8, grad_accum=3), "not a multiple of grad_accum"),
    (dict(batch_size=6, mesh=MeshConfig(data=4)), "does not divide over data x fsdp"),
    (dict(compute_dtype="float16"), "compute_dtype"),
    (dict(objective="dpo"), "unknown objective"),
    (dict(length_bucket=-8), "length_bucket=-8; use 0"),
    (dict(seq_len=64, length_bucket=128), r"a bucket in \(0, seq_len=64\]"),
])
def test_bad_training_configs_name_the_problem(fields, message):
  with pytest.raises(ConfigError, match=message):
    TrainConfig(**fields)


def test_mesh_text_reads_as_data_fsdp_tensor():
  assert parse_mesh("1,4,2") == MeshConfig(data=1, fsdp=4, tensor=2)
  for text in ("1,4", "1,4,2,1", "a,b,c", ""):
    with pytest.raises(ConfigError, match="expected three integers data,fsdp,tensor"):
      parse_mesh(text)


def test_mesh_that_does_not_match_devices_or_shapes_is_refused():
  with pytest.raises(ConfigError, match="devices"):
    make_mesh(MeshConfig(data=2), jax.devices()[:1])
  model = tiny_model()  # built outside the trace: the cached model must never hold tracers
  params = jax.eval_shape(lambda: model.params)
  with pytest.raises(ConfigError, match="does not divide"):
    param_specs(params, {"data": 1, "fsdp": 3, "tensor": 1})  # embed 64 over fsdp 3


def test_config_file_errors(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    load_train_config(tmp_path / "missing.json")
  bad = tmp_path / "bad.json"
  bad.write_text('{"batch_size": 8, "learnin_rate": 1e-5}')
  with pytest.raises(ConfigError, match="learnin_rate"):
    load_train_config(bad)
