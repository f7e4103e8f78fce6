"""Run in a fresh process with 8 simulated CPU devices: every method decodes on one device and on meshes
(tensor 8; data 2 x tensor 4), greedy and sampled; prints one JSON line for tests/test_decode_sharding.py.

  python -m tests.decode_sharding_worker tiny-gemma3 8 1x8 2x4   # model, KV heads (of 8 query heads), meshes
  python -m tests.decode_sharding_worker tiny-gemma1 1 2x4 brief # sequential greedy and PASTA forced only
  python -m tests.decode_sharding_worker gemma3-270m 1 2x4       # the real 270M (4 query heads, 1 KV head)
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pasta_jax.decode import api, loop  # noqa: E402
from pasta_jax.decode.runtime import Runtime  # noqa: E402
from pasta_jax.decode.sampling import SamplingConfig  # noqa: E402
from pasta_jax.methods import Apar, Pasta, Sequential, generate, prepare_run  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

PASTA = ('Two tips:\n<promise topic="sleep" tokens="20"/><async>- Sleep eight hours.\n</async>'
         '<promise topic="food" tokens="10"/><async>- Eat greens.\n</async><sync/>Done.')
APAR = "Two tips:\n<fork/><child>- Sleep eight hours.\n</child><fork/><child>- Eat greens.\n</child>Done."
SAMPLED = SamplingConfig(temperature=1.0, top_k=20, seed=3)


def mesh(data: int, tensor: int) -> Mesh:
  return Mesh(np.asarray(jax.devices()[: data * tensor], dtype=object).reshape(data, 1, tensor),
              ("data", "fsdp", "tensor"))


BRIEF = ("sequential-greedy", "pasta-forced")  # the families after the first: one greedy and one threaded case


def runs(model, mesh_or_none, cases=None):
  prompts = ["q", "tips?"]
  kw = dict(runtime=Runtime(mesh=mesh_or_none), max_new_tokens=12, return_logits=True)
  table = {
      "sequential-greedy": lambda: generate(model, prompts, Sequential(), **kw),
      "sequential-sampled": lambda: generate(model, prompts, Sequential(), sampling=SAMPLED, **kw),
      "pasta-free-sampled": lambda: generate(model, prompts, Pasta(lanes=4), sampling=SAMPLED, **kw),
      "pasta-forced": lambda: generate(model, prompts, Pasta(lanes=4), forced_answers=[PASTA] * 2, **kw),
      "apar-forced": lambda: generate(model, prompts, Apar(lanes=4), forced_answers=[APAR] * 2, **kw),
  }
  return {name: [(r.records.tolist(), r.finished, r.truncated, [dataclass_tuple(t) for t in r.threads], r.logits)
                 for r in run()] for name, run in table.items() if cases is None or name in cases}


def dataclass_tuple(trace):
  return (trace.thread, trace.lane, trace.spawn_step, trace.finish_step, trace.tokens)


def compare(one, many):
  out = {}
  for name in one:
    same = all(a[:4] == b[:4] for a, b in zip(one[name], many[name], strict=True))
    diff = max(float(np.max(np.abs(a[4] - b[4]))) for a, b in zip(one[name], many[name], strict=True))
    out[name] = {"same": same, "max_logit_diff": diff}
  return out


def compiled_loop(model, m) -> dict:
  """The compiled sequential loop on mesh `m`: its all-gathers whose result has a whole weight matrix's
  shape, and the pool's global and per-device shapes after a run."""
  prep = prepare_run(model, [[2, 3, 4], [2, 5]], Sequential(), max_new_tokens=8, runtime=Runtime(mesh=m))
  executable = api.COMPILED.get(prep, loop.prefill_and_run)
  weights = {tuple(np.shape(x)) for x in jax.tree.leaves(prep.params) if np.ndim(x) >= 2}
  gathered = []
  for line in executable.as_text().splitlines():
    if "all-gather(" in line or "all-gather-start(" in line:
      result_type = line.split("=", 1)[1].split("all-gather", 1)[0]
      if any(tuple(int(d) for d in dims.split(",")) in weights for dims in re.findall(r"\[([0-9,]+)\]", result_type)):
        gathered.append(line.strip()[:200])
  pool = executable(*api.dynamic_args(prep)).pool.k
  return {"gathered_weights": gathered, "pool": [list(pool.shape), list(pool.addressable_shards[0].data.shape)]}


def memory_check(model, name: str, m) -> dict:
  """`pasta plan`'s decode figures against XLA's memory analysis of the compiled loop, per device."""
  from pasta_jax.training.decode_plan import DecodeConfig, decode_plan
  prep = prepare_run(model, [[2] + [100] * 200] * 4, Pasta(lanes=8), max_new_tokens=512, runtime=Runtime(mesh=m))
  stats = api.COMPILED.get(prep, loop.prefill_and_run).memory_analysis()
  xla = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
         - stats.alias_size_in_bytes)
  mesh_shape = {"data": m.shape["data"], "fsdp": m.shape["fsdp"], "tensor": m.shape["tensor"]}
  plan = decode_plan(DecodeConfig(name, "cpu", mesh_shape, batch=4, lanes=8, pool_slots=prep.cfg.pool_slots,
                                  prompt_len=prep.tokens.shape[1], dtype="float32"))
  return {"plan_bytes": plan.total, "xla_bytes": xla, "plan_parts": dict(plan.parts)}


def main(name: str, kv_heads: int | None, meshes: list[tuple[int, int]], cases=None) -> None:
  assert len(jax.devices()) == 8, jax.devices()
  if name == "gemma3-270m":
    from pasta_jax.model.load import load_model
    model = load_model("base")
  else:  # 8 query heads, split over tensor; KV heads split when they divide it, replicated otherwise
    model = tiny_model(name, num_heads=8, num_kv_heads=kv_heads)
  one = runs(model, None, cases)
  report = {}
  for data, tensor in meshes:
    m = mesh(data, tensor)
    report[f"data{data}-tensor{tensor}"] = {"methods": compare(one, runs(model, m, cases)), **compiled_loop(model, m)}
  if name == "gemma3-270m":
    report["memory"] = memory_check(model, name, mesh(*meshes[0]))
  print(json.dumps(report))


if __name__ == "__main__":
  name, kv, *shapes = sys.argv[1:]  # shapes: "DATAxTENSOR", e.g. 2x4; "brief": only the BRIEF cases
  brief = "brief" in shapes
  main(name, int(kv), [tuple(int(x) for x in shape.split("x")) for shape in shapes if shape != "brief"],
       BRIEF if brief else None)
