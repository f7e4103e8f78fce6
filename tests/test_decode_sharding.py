"""Sharded decoding: on 8 simulated CPU devices, every method decodes on a mesh exactly as on
one device, no step gathers a whole weight matrix, and the pool is split over its mesh axes. A method
that does not declare `shard` is refused on a mesh by name.

Each case runs tests/decode_sharding_worker.py in a fresh process (the device count is fixed at start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError
from pasta_jax.methods import Capabilities, Sequential, registry
from tests.marks import HEAVY

ROOT = Path(__file__).resolve().parents[1]
LOGIT_TOL = {"tiny": 1e-4, "real": 2e-3}  # tests/test_hf_parity.py's tolerances (float32, other summation order)
# What each case must exercise, so that its equality means something: threads a request ran (forks, points,
# scopes), and a tree's accepted tokens per step
EXERCISES = {"pasta-forced": ("threads", 3), "apar-forced": ("threads", 3), "sot-greedy": ("threads", 2),
             "sot-sampled": ("threads", 3), "scoped-forced": ("threads", 4), "pasta-trees-forks": ("threads", 2),
             "medusa-greedy": ("accept_length", 1.5), "propd-greedy": ("accept_length", 1.2),
             "pasta-trees-greedy": ("accept_length", 1.1)}


def run_worker(*args: str) -> dict:
  out = subprocess.run([sys.executable, "-m", "tests.decode_sharding_worker", *args], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ), timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def check(report: dict, kv_heads: int, tolerance: float = LOGIT_TOL["tiny"]) -> None:
  for mesh_name, got in report.items():
    if mesh_name == "memory":
      continue
    data, tensor = (int(part.removeprefix("data").removeprefix("tensor")) for part in mesh_name.split("-"))
    for case, result in got["methods"].items():
      assert result["same"], f"{mesh_name} {case}: records, flags, traces, texts, drafts or tree counts differ"
      assert result["max_logit_diff"] < tolerance, (mesh_name, case, result)
      assert result["score_diff_per_token"] < tolerance, (mesh_name, case, result)  # Superposed's drafts
      assert result["gathered_weights"] == [], f"{mesh_name} {case}: a step gathers whole weights"
      what, least = EXERCISES.get(case, ("threads", 1))
      assert result[what] >= least, f"{mesh_name} {case}: {what} {result[what]} < {least}: a vacuous comparison"
    assert got["gathered_weights"] == [], f"{mesh_name}: a step gathers whole weights: {got['gathered_weights']}"
    whole, shard = got["pool"]  # [layers, B, S, K, hd]
    split_heads = tensor if kv_heads % tensor == 0 else 1  # KV heads that do not divide are replicated
    assert shard == [whole[0], whole[1] // data, whole[2], whole[3] // split_heads, whole[4]], (mesh_name, got["pool"])


# 8 query heads on every tiny model. KV heads: split 8 ways on tensor 8 (Gemma 3: every method), split 4 ways on
# data 2 x tensor 4 (Gemma 2, GQA 8:4), replicated (Gemma 1, MQA). The suite runs Gemma 3 on tensor 8 with the
# worker's DEFAULT cases, in one process: sequential greedy, PASTA sampled and forced, APAR forced, and one
# brief greedy case of each other method (SoT's fan-out, Superposed without an n-gram index, the scoped mode forced,
# Medusa and ProPD on 2-node trees, PASTA x trees writing a fork under a fork-writing bias). With PASTA_HEAVY_TESTS=1
# (to keep the suite within CI's time): every case on data 2 x tensor 4 ("heavy": also sampled SoT and scoped runs,
# Superposed's n-gram index, Medusa's typical acceptance, ProPD's 8-node tree, trees without forks), and two cases of
# each of the other two families ("brief").


@pytest.mark.parametrize("name, kv_heads, meshes", [
    ("tiny-gemma3", 8, ["1x8"]), pytest.param("tiny-gemma3", 8, ["2x4", "heavy"], marks=HEAVY),
    pytest.param("tiny-gemma2", 4, ["2x4", "brief"], marks=HEAVY),
    pytest.param("tiny-gemma1", 1, ["2x4", "brief"], marks=HEAVY)])
def test_tiny_gemmas_decode_on_a_mesh_as_on_one_device(name, kv_heads, meshes):
  report = run_worker(name, str(kv_heads), *meshes)
  check(report, kv_heads)
  if "brief" not in meshes:  # every method that says it runs on a mesh is among the cases that showed it
    for got in report.values():
      assert {r["method"] for r in got["methods"].values()} == set(registry.names(shard=True))


def test_a_method_not_tested_on_a_mesh_is_refused_there_by_name():
  """`Capabilities.shard` is the one gate: a method without it (a plug-in's, say) is refused on a mesh, named."""
  class Unsharded(Sequential):
    name = "unsharded"
    capabilities = Capabilities(stream=True, replay=True)

  mesh = object()  # the check reads only whether a mesh is given
  with pytest.raises(PastaError, match="method='unsharded' is not tested on a mesh"):
    Unsharded().check_request(sampling=SamplingConfig(), runtime=Runtime(mesh=mesh), forced=False)
  Unsharded().check_request(sampling=SamplingConfig(), runtime=Runtime(), forced=False)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PASTA_HEAVY_TESTS"), reason="about 10 minutes on 2 cores (five methods and "
                    "the memory check compiled for 8 devices): set PASTA_HEAVY_TESTS=1, or run "
                    "`python -m tests.decode_sharding_worker gemma3-270m 1 2x4`")
def test_the_real_270m_decodes_on_a_mesh_as_on_one_device_and_as_planned():
  report = run_worker("gemma3-270m", "1", "2x4")  # 4 query heads: tensor 8 does not divide them
  check(report, kv_heads=1, tolerance=LOGIT_TOL["real"])  # measured 1.4e-4 on logits of magnitude ~30
  memory = report["memory"]  # `pasta plan`'s per-device total vs XLA's memory analysis of the compiled loop
  assert abs(memory["plan_bytes"] / memory["xla_bytes"] - 1) < 0.10, memory
