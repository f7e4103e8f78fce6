"""Training and decoding in two real JAX processes (`jax.distributed` on 127.0.0.1, CPU collectives over gloo, one
device each), against the same work in this one process on one device.

Two tests/two_process_worker.py processes train the tiny model one step on a mesh whose fsdp axis spans them,
checkpoint it together, resume in a fresh trainer for the second step and export the model; then decode
(Sequential greedy, PASTA forced) with the requests split across them. Meanwhile this process runs the same
functions on its one device. The losses, the export, and every record, flag and thread trace must agree (logits to
float tolerance), and the processes must slice each global batch as the mesh places it. Cost: about 46 CPU-seconds
(each worker 18, this process's own run 10), so about 25 s of a 2-core suite's time; alone on 2 cores shared with
other work it took 76-79 s.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from pasta_jax.model.checkpoint import restore_checkpoint
from pasta_jax.training.metrics_log import read_metrics
from tests import two_process_worker as worker
from tests.marks import HEAVY

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # both processes together; a hung collective fails the test after this, with both outputs
LOGIT_TOL = 1e-4  # tests/test_decode_sharding.py's (float32, another summation order)
TAIL_LINES = 30


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_workers(out_dir: Path, mode: str) -> list[tuple[subprocess.Popen, Path]]:
  port = free_port()
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"  # whatever the user simulates
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  workers = []
  for i in range(worker.PROCESSES):
    log = out_dir / f"process-{i}.log"
    with open(log, "w") as out:  # the child keeps its own descriptor
      proc = subprocess.Popen([sys.executable, "-m", "tests.two_process_worker", str(i), str(port), str(out_dir), mode],
                              cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    workers.append((proc, log))
  return workers


def finish_workers(workers, deadline: float) -> None:
  """Waits for both; one that fails (or the deadline) ends the other at once. Fails with each one's output tail."""
  while any(proc.poll() is None for proc, _ in workers):
    failed = any(proc.poll() not in (None, 0) for proc, _ in workers)
    if failed or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  fates = []
  for proc, _ in workers:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
      fates.append("killed (the other failed, or the time ran out)")
    else:
      fates.append(f"exit {proc.returncode}")
  if any(proc.returncode != 0 for proc, _ in workers):
    late = " after the time limit" if time.monotonic() > deadline else ""
    tails = [f"--- process {i}: {fate}; its last lines:\n" + "\n".join(log.read_text().splitlines()[-TAIL_LINES:])
             for i, ((_, log), fate) in enumerate(zip(workers, fates))]
    raise AssertionError(f"the two-process run failed{late}\n" + "\n".join(tails))


def differences(name: str, got: list[dict], want: list[dict]) -> list[str]:
  """What differs between one decode case's results in the two processes and in one."""
  found = []
  for b, (g, w) in enumerate(zip(got, want, strict=True)):
    for key in ("records", "flags", "traces"):
      if g[key] != w[key]:
        found.append(f"{name} prompt {b}: {key} differ: {g[key]} vs one process's {w[key]}")
    gap = float(np.max(np.abs(np.asarray(g["logits"]) - np.asarray(w["logits"]))))
    if gap >= LOGIT_TOL:
      found.append(f"{name} prompt {b}: logits differ by {gap:.2g}")
  return found


def run_pair(out_dir: Path, own_run, mode: str = "all") -> tuple[list[dict], object]:
  """Starts the two worker processes, runs `own_run()` here while they work, and waits for them: (each one's
  report, own_run's result)."""
  began = time.monotonic()
  workers = start_workers(out_dir, mode)
  try:
    own = own_run()
  except BaseException:
    for proc, _ in workers:
      proc.kill()
      proc.wait()
    raise
  finish_workers(workers, began + TIMEOUT_S)
  return [json.loads((out_dir / f"process-{i}.json").read_text()) for i in range(worker.PROCESSES)], own


def gaps(got, want) -> np.ndarray:
  return np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                         for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)])


def test_two_processes_train_resume_and_decode_as_one_process(tmp_path):
  one_device = jax.devices()[:1]
  reports, (want_train, want_decode) = run_pair(tmp_path, lambda: (
      worker.train(str(tmp_path / "one"), worker.ONE_DEVICE, one_device, resume=False), worker.decode(None)))

  for i, got in enumerate(reports):
    # each process feeds the rows its device holds: its half on fsdp or data, the whole batch where tensor spans both
    assert got["batch_slices"] == {"fsdp2": [i, 2], "data2": [i, 2], "tensor2": [0, 1]}, got["batch_slices"]
    assert "must feed slice" in got["refusal"], got["refusal"]  # a whole batch per process is refused, not mixed
    assert got["train"]["resumed_from"] == 1
    np.testing.assert_allclose(got["train"]["losses"], want_train["losses"], rtol=1e-5)
    problems = [p for name, want in want_decode.items() for p in differences(name, got["decode"][name], want)]
    assert not problems, f"process {i}:\n" + "\n".join(problems)
  assert [row["step"] for row in read_metrics(tmp_path / "train")] == [0, 1]  # one writer, the resumed row once

  # the model the two processes exported (each held half of every weight) loads here, equal to the one-device export
  gap = gaps(restore_checkpoint(reports[0]["train"]["model_dir"])[1], restore_checkpoint(want_train["model_dir"])[1])
  # Adam's first update is ~lr * sign(g): a gradient within rounding of 0 may flip sign, nothing else may differ
  assert np.mean(gap > 1e-6) < 1e-3 and gap.max() < 5e-3, (np.mean(gap > 1e-6), gap.max())


@HEAVY
def test_two_processes_train_an_adapter_split_over_tensor_as_one_process(tmp_path):
  """Tensor spans the processes: both feed the whole batch, and the adapter's exported factors are gathered whole."""
  from pasta_jax.model import lora
  reports, want = run_pair(tmp_path, lambda: worker.train_adapter(str(tmp_path / "one"), worker.ONE_DEVICE,
                                                                   jax.devices()[:1]), "adapter")
  for got in reports:
    assert got["batch_slice"] == [0, 1]
    np.testing.assert_allclose(got["train"]["losses"], want["losses"], rtol=1e-5)
  gap = gaps(lora.load_adapter(reports[0]["train"]["model_dir"])[0], lora.load_adapter(want["model_dir"])[0])
  assert np.mean(gap > 1e-6) < 1e-3 and gap.max() < 5e-2, (np.mean(gap > 1e-6), gap.max())
