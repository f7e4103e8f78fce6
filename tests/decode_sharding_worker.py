"""Run in a fresh process with 8 simulated CPU devices: every method decodes on one device and on meshes
(tensor 8; data 2 x tensor 4), greedy and sampled; prints one JSON line for tests/test_decode_sharding.py.

  python -m tests.decode_sharding_worker tiny-gemma3 8 1x8       # model, KV heads (of 8 query heads), meshes: DEFAULT
  python -m tests.decode_sharding_worker tiny-gemma3 8 2x4 heavy # every case of every method (`cases`)
  python -m tests.decode_sharding_worker tiny-gemma1 1 2x4 brief # sequential greedy and PASTA forced only
  python -m tests.decode_sharding_worker gemma3-270m 1 2x4       # the real 270M (4 query heads, 1 KV head)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from pasta_jax.decode import api, loop  # noqa: E402
from pasta_jax.decode.ngram import NgramIndex  # noqa: E402
from pasta_jax.decode.runtime import Runtime  # noqa: E402
from pasta_jax.decode.sampling import SamplingConfig  # noqa: E402
from pasta_jax.decode.speculation import Drafter  # noqa: E402
from pasta_jax.decode.tokenizing import prompt_ids  # noqa: E402
from pasta_jax.methods import (  # noqa: E402
  Apar,
  Medusa,
  Pasta,
  PastaTrees,
  Propd,
  Scoped,
  Sequential,
  Sot,
  Superposed,
  generate_ids,
  prepare_run,
)
from pasta_jax.model import medusa  # noqa: E402
from tests.tiny import TEXT_BASE, biased_model_fn, tiny_model  # noqa: E402

PASTA = ('Two tips:\n<promise topic="sleep" tokens="20"/><async>- Sleep eight hours.\n</async>'
         '<promise topic="food" tokens="10"/><async>- Eat greens.\n</async><sync/>Done.')
APAR = "Two tips:\n<fork/><child>- Sleep eight hours.\n</child><fork/><child>- Eat greens.\n</child>Done."
SCOPED = ("Two fuels:\n<scope>1. Coal:<promise/><async> a fossil fuel.</async>\n2. Wood:<promise/><async> it regrows."
          "\n<scope>- Oak:<promise/><async> dense.</async></scope></async>\n</scope>Both burn.")
POINTS = ("1. Sleep:", "2. Food:", "3. Walk:")  # SoT's point prompts: each forced on its own lane, then decoded
SAMPLED = SamplingConfig(temperature=1.0, top_k=20, seed=3)
PROMPTS = ["q", "tips?"]
MAX_NEW_TOKENS = 12
PROPD_TIMES = {1: 1.0, 2: 1.3}  # step seconds by tree size: ProPD takes plain steps, then trees as its heads hit


def mesh(data: int, tensor: int) -> Mesh:
  return Mesh(np.asarray(jax.devices()[: data * tensor], dtype=object).reshape(data, 1, tensor),
              ("data", "fsdp", "tensor"))


def once(build):
  """`build(model)` made once per model (a model is not hashable)."""
  made = {}

  @functools.wraps(build)
  def get(model):
    if id(model) not in made:
      made[id(model)] = build(model)
    return made[id(model)]
  return get


@once
def heads(model) -> Drafter:
  """Two random Medusa heads around the tied output head (so the tiny model's loops get multi-token paths)."""
  config = medusa.MedusaConfig(num_heads=2)
  fresh = medusa.init_heads(config, model.params["params"]["embedder"])
  key = jax.random.key(1)
  noisy = {k: v if k == "out" else v + 0.3 * jax.random.normal(jax.random.fold_in(key, i), v.shape)
           for i, (k, v) in enumerate(fresh.items())}
  return Drafter(noisy, config, np.full((2, 8), 0.3, np.float32))


@once
def ngram_index(model) -> NgramIndex:
  tok = model.tokenizer
  return NgramIndex.build([tok.encode(t, add_bos=False) for t in ("the cat sat on the mat", "a dog ran to the cat")])


def fork_writing_bias(model) -> jax.Array:
  """[V, V] logit biases by the input token under which the tiny model's greedy choice writes one PASTA fork, whatever
  its own (scaled down) logits: main `a<promise topic="T" tokens=L/>b<sync/>d` and an end, the fork `c</async>`."""
  vocab, char = model.tokenizer.tag_vocab(), lambda c: TEXT_BASE + ord(c)
  bias = np.full((model.config.vocab_size,) * 2, -50.0, np.float32)
  for given, then in ((char("\n"), char("a")), (char("a"), vocab.promise), (vocab.promise, char("T")),
                      (char("T"), vocab.lengths[0]), (vocab.lengths[0], char("b")), (char("b"), vocab.sync),
                      (vocab.sync, char("d")), (char("d"), vocab.eos_ids[0]),
                      (vocab.async_open, char("c")), (char("c"), vocab.async_close)):
    bias[given, then] = 10.0  # (the chat prompt ends in a newline)
  return jnp.asarray(bias)


@contextlib.contextmanager
def fork_writing(model):
  """Runs prepared inside decode the model bent by `fork_writing_bias` (a model function of their own)."""
  original = api.model_fn
  api.model_fn = biased_model_fn(original, fork_writing_bias(model))
  try:
    yield
  finally:
    api.model_fn = original


def cases(model) -> dict:
  """name -> () -> (method, generate_ids options, whether the fork-writing bias bends the model)."""
  points = [model.tokenizer.encode(p, add_bos=False) for p in POINTS]
  return {
      "sequential-greedy": lambda: (Sequential(), {}, False),
      "sequential-sampled": lambda: (Sequential(), dict(sampling=SAMPLED), False),
      "pasta-free-sampled": lambda: (Pasta(lanes=4), dict(sampling=SAMPLED), False),
      "pasta-forced": lambda: (Pasta(lanes=4), dict(forced_answers=[PASTA] * 2), False),
      "apar-forced": lambda: (Apar(lanes=4), dict(forced_answers=[APAR] * 2), False),
      # one case of each further method (the default suite's)
      "sot-greedy": lambda: (Sot(lanes=2, max_threads=2), dict(scripts=[points[:2]] * 2), False),
      "superposed-plain": lambda: (Superposed(drafts=3, ngram=None), {}, False),
      "scoped-forced": lambda: (Scoped(lanes=4), dict(forced_answers=[SCOPED] * 2), False),
      "medusa-greedy": lambda: (Medusa(heads=heads(model), tree_size=2), {}, False),
      "propd-greedy": lambda: (Propd(heads=heads(model), tree_size=2, latency=PROPD_TIMES), {}, False),
      "pasta-trees-forks": lambda: (PastaTrees(heads=heads(model), tree_size=2, lanes=2, max_threads=2), {}, True),
      # heavier ones ("heavy")
      "sot-sampled": lambda: (Sot(lanes=4, max_threads=3), dict(scripts=[points] * 2, sampling=SAMPLED), False),
      "scoped-free-sampled": lambda: (Scoped(lanes=4), dict(sampling=SAMPLED), False),
      "superposed-ngram": lambda: (Superposed(drafts=3, ngram=ngram_index(model)), {}, False),
      "medusa-typical-sampled": lambda: (Medusa(heads=heads(model), tree_size=4, acceptance="typical"),
                                         dict(sampling=SAMPLED), False),
      "propd-sampled": lambda: (Propd(heads=heads(model), tree_size=8, latency={1: 1.0, 2: 1.5, 4: 1.9, 8: 2.5}),
                                dict(sampling=SAMPLED), False),
      "pasta-trees-greedy": lambda: (PastaTrees(heads=heads(model), tree_size=4, lanes=2), {}, False),
  }


FIRST = ("sequential-greedy", "sequential-sampled", "pasta-free-sampled", "pasta-forced", "apar-forced")
# the suite's: the first cases but sampled sequential (PASTA's sampled case covers sampling on a mesh), and one brief
# case of each method past the first three
DEFAULT = (*(name for name in FIRST if name != "sequential-sampled"), "sot-greedy", "superposed-plain", "scoped-forced",
           "medusa-greedy", "propd-greedy", "pasta-trees-forks")
BRIEF = ("sequential-greedy", "pasta-forced")  # the families after the first: one greedy and one threaded case


def runs(model, mesh_or_none, names=None):
  """Every case in `names` (None: all) on `mesh_or_none` (None: one device)."""
  ids = prompt_ids(model.tokenizer, PROMPTS, True)
  out = {}
  for name, case in cases(model).items():
    if names is not None and name not in names:
      continue
    method, options, bent = case()
    kw = dict(runtime=Runtime(mesh=mesh_or_none), max_new_tokens=MAX_NEW_TOKENS, return_logits=True, **options)
    with fork_writing(model) if bent else contextlib.nullcontext():
      results = generate_ids(model, ids, method, **kw)
      gathered = None if mesh_or_none is None else gathered_weights(prepare_run(model, ids, method, **kw))
    out[name] = {"runs": [(r.records.tolist(), r.finished, r.truncated, [dataclass_tuple(t) for t in r.threads],
                           r.text, r.drafts, r.speculation, np.asarray(r.draft_scores), r.logits) for r in results],
                 "gathered": gathered, "method": method.name}
  return out


def dataclass_tuple(trace):
  return (trace.thread, trace.lane, trace.spawn_step, trace.finish_step, trace.tokens)


def compare(one, many):
  """Per case: whether records, flags, traces, texts, drafts and speculation counts are equal; the largest difference
  of a logit and of a draft's score (per token); which weights its compiled loop on the mesh gathers whole; and what it
  exercised (the most threads of a request, the best accepted length of a tree)."""
  out = {}
  for name in one:
    pairs = list(zip(one[name]["runs"], many[name]["runs"], strict=True))
    out[name] = {"method": one[name]["method"], "same": all(a[:7] == b[:7] for a, b in pairs),
                 "max_logit_diff": max(largest_difference(a[8], b[8]) for a, b in pairs),
                 # a draft's score sums at most MAX_NEW_TOKENS log-probabilities, each within twice a logit's error
                 "score_diff_per_token": max(largest_difference(a[7], b[7]) for a, b in pairs) / (2 * MAX_NEW_TOKENS),
                 "gathered_weights": many[name]["gathered"],
                 "threads": max(len({record[2] for record in a[0]}) for a, _ in pairs),
                 "accept_length": max((a[6] or {}).get("accept_length", 0.0) for a, _ in pairs)}
  return out


def largest_difference(x, y) -> float:
  return float(np.max(np.abs(x - y), initial=0.0)) if np.shape(x) == np.shape(y) else float("inf")


def gathered_weights(prep) -> list[str]:
  """The compiled loop of `prep` (from the compile cache): its all-gathers whose result has a whole weight matrix's
  shape."""
  executable = api.COMPILED.get(prep, loop.prefill_and_run)
  weights = {tuple(np.shape(x)) for x in jax.tree.leaves(prep.params) if np.ndim(x) >= 2}
  gathered = []
  for line in executable.as_text().splitlines():
    if "all-gather(" in line or "all-gather-start(" in line:
      result_type = line.split("=", 1)[1].split("all-gather", 1)[0]
      if any(tuple(int(d) for d in dims.split(",")) in weights for dims in re.findall(r"\[([0-9,]+)\]", result_type)):
        gathered.append(line.strip()[:200])
  return gathered


def compiled_loop(model, m) -> dict:
  """The compiled sequential loop on mesh `m`: its all-gathers whose result has a whole weight matrix's
  shape, and the pool's global and per-device shapes after a run."""
  prep = prepare_run(model, [[2, 3, 4], [2, 5]], Sequential(), max_new_tokens=8, runtime=Runtime(mesh=m))
  pool = api.COMPILED.get(prep, loop.prefill_and_run)(*api.dynamic_args(prep)).pool.k
  return {"gathered_weights": gathered_weights(prep),
          "pool": [list(pool.shape), list(pool.addressable_shards[0].data.shape)]}


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


def main(name: str, kv_heads: int | None, meshes: list[tuple[int, int]], names=DEFAULT) -> None:
  assert len(jax.devices()) == 8, jax.devices()
  if name == "gemma3-270m":
    from pasta_jax.model.load import load_model
    model = load_model("base")
    names = FIRST if names == DEFAULT else names  # (the fork-writing bias would be [V, V] of its 262k vocabulary)
  else:  # 8 query heads, split over tensor; KV heads split when they divide it, replicated otherwise
    model = tiny_model(name, num_heads=8, num_kv_heads=kv_heads)
  one = runs(model, None, names)
  report = {}
  for data, tensor in meshes:
    m = mesh(data, tensor)
    report[f"data{data}-tensor{tensor}"] = {"methods": compare(one, runs(model, m, names)), **compiled_loop(model, m)}
  if name == "gemma3-270m":
    report["memory"] = memory_check(model, name, mesh(*meshes[0]))
  print(json.dumps(report))


if __name__ == "__main__":
  name, kv, *shapes = sys.argv[1:]  # shapes: "DATAxTENSOR", e.g. 2x4; "brief": only BRIEF; "heavy": every case
  chosen = BRIEF if "brief" in shapes else None if "heavy" in shapes else DEFAULT
  main(name, int(kv), [tuple(int(x) for x in shape.split("x")) for shape in shapes if "x" in shape], chosen)
