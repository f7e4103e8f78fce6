"""The thread-metadata attention kernels equal XLA attention: values and gradients, on random metadata (random
thread tables and horizons, invalid slots, sliding windows, soft caps, grouped-query head layouts, pools of 128 to
4096 slots), both Pallas kernels in interpret mode on CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode.runtime import Runtime
from pasta_jax.methods import Pasta, generate
from pasta_jax.model.thread_attention import AttentionSpec, attention, block_summaries, resolve
from pasta_jax.visibility import HIDDEN, UNBOUNDED, ThreadMask
from tests.marks import HEAVY

KERNELS = ("pallas-tpu", "pallas-gpu")


def kernel_spec(spec: AttentionSpec, kernel: str) -> AttentionSpec:
  """The kernel compiled for real on its own device (the GPU kernel on a GPU), interpreted anywhere else."""
  return dataclasses.replace(spec, implementation=kernel, interpret=resolve(kernel)[1])


def random_case(seed: int, *, batch=2, queries=8, slots=256, threads=6, heads=4, kv_heads=2, head_dim=16,
                invalid=0.2):
  """Random pool metadata as an interpreter writes it: owners, increasing write orders, some invalid slots;
  horizons per query row and thread mixing hidden, bounded and unbounded views."""
  rng = np.random.default_rng(seed)
  owner = rng.integers(0, threads, (batch, slots))
  order = np.broadcast_to(np.arange(slots), (batch, slots)).copy()
  valid = rng.random((batch, slots)) > invalid
  horizon = rng.integers(-1, slots, (batch, queries, threads))
  horizon = np.where(rng.random(horizon.shape) < 0.2, UNBOUNDED, horizon)
  horizon = np.where(rng.random(horizon.shape) < 0.2, HIDDEN, horizon)
  horizon[0, 0, :] = HIDDEN  # a row that sees nothing (an inactive lane): zeros, not NaN
  mask = ThreadMask(*(jnp.asarray(x, t) for x, t in ((horizon, jnp.int32), (owner, jnp.int32), (order, jnp.int32),
                                                      (valid, bool))))
  q = jnp.asarray(rng.normal(size=(batch, queries, heads, head_dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(batch, slots, kv_heads, head_dim)), jnp.float32) for _ in range(2))
  kv_pos = jnp.asarray(rng.integers(0, slots, (batch, slots)), jnp.int32)
  q_pos = jnp.asarray(rng.integers(0, slots, (batch, queries)), jnp.int32)
  return q, k, v, mask, q_pos, kv_pos


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([128, 512, 1024]),
       heads=st.sampled_from([(4, 1), (4, 2), (8, 8)]), softcap=st.sampled_from([None, 50.0]),
       window=st.sampled_from([None, 64]))
def test_kernel_equals_xla(kernel, seed, slots, heads, softcap, window):
  q, k, v, mask, q_pos, kv_pos = random_case(seed, slots=slots, heads=heads[0], kv_heads=heads[1])
  spec = AttentionSpec(scale=0.25, softcap=softcap, window=window, block_q=4, block_k=128)
  want = attention(q, k, v, mask, q_pos, kv_pos, spec)
  got = attention(q, k, v, mask, q_pos, kv_pos, kernel_spec(spec, kernel))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  assert not np.asarray(want[0, 0]).any()  # the row that sees nothing


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_xla_on_a_4096_slot_pool(kernel):
  q, k, v, mask, q_pos, kv_pos = random_case(7, batch=1, queries=4, slots=4096, heads=8, kv_heads=1, head_dim=32)
  spec = AttentionSpec(scale=0.2, window=512, block_q=4, block_k=512)
  want = attention(q, k, v, mask, q_pos, kv_pos, spec)
  got = attention(q, k, v, mask, q_pos, kv_pos, kernel_spec(spec, kernel))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_gradients_equal_xla(kernel):
  q, k, v, mask, q_pos, kv_pos = random_case(3, slots=128)
  spec = AttentionSpec(scale=0.25, softcap=30.0, block_q=4, block_k=64)

  def loss(spec_):
    return lambda q_, k_, v_: jnp.sum(jnp.sin(attention(q_, k_, v_, mask, q_pos, kv_pos, spec_)))

  want = jax.grad(loss(spec), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(kernel_spec(spec, kernel)), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_block_summaries_bound_every_visible_pair():
  """A tile the summaries call empty holds no visible pair (so skipping it is exact), and they do call some
  tiles empty on a forked pool (so the kernels do skip work)."""
  _, _, _, mask, _, _ = random_case(11, batch=1, queries=8, slots=512, invalid=0.5)
  horizon = np.asarray(mask.horizon).copy()
  horizon[:, 4:, :] = np.where(horizon[:, 4:, :] == UNBOUNDED, 100, np.minimum(horizon[:, 4:, :], 100))
  mask = dataclasses.replace(mask, horizon=jnp.asarray(horizon))
  q_max, k_min = (np.asarray(x) for x in block_summaries(mask, 2, 4))
  dense = np.asarray(mask.dense())[0]
  live = (k_min[0][None, :, :] <= q_max[0][:, None, :]).any(-1)  # [nq, nk]
  for i in range(2):
    for j in range(4):
      if not live[i, j]:
        assert not dense[i * 4:(i + 1) * 4, j * 128:(j + 1) * 128].any()
  assert not live.all()




@pytest.mark.parametrize("name", [pytest.param("tiny-gemma1", marks=HEAVY), "tiny-gemma2",
                                  pytest.param("tiny-gemma3", marks=HEAVY)])
def test_training_forward_and_gradients_with_the_kernel_equal_xla(name):
  """The model's one switch, on a PASTA training layout: Gemma 2 (GQA, soft caps, sliding windows) in the suite,
  Gemma 1 (MQA) and Gemma 3 (QK norm) with PASTA_HEAVY_TESTS=1 (the kernel runs interpreted on CPU)."""
  from pasta_jax.lang.layout import layout_example, pad_layout
  from pasta_jax.model.gemma import Gemma
  from tests.test_replay import ANSWER, PROMPT, VOCAB, random_params, with_blocks
  cfg, _, params = random_params(name)
  cfg = dataclasses.replace(cfg, sliding_window=8) if "local" in cfg.layer_kinds else cfg  # windows that bite
  layout = layout_example(PROMPT, with_blocks(ANSWER), VOCAB)
  layout = pad_layout(layout, 128, layout.num_threads)  # a training length: whole 8 x 128 tiles
  batch = (jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None])
  mask = jax.tree.map(lambda x: x[None], layout.thread_mask())

  def loss(attention):
    model = Gemma(cfg, attention=attention)
    return lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, *batch, mask).logits)[..., 7])

  want_value, want_grad = jax.value_and_grad(loss("xla"))(params)
  got_value, got_grad = jax.value_and_grad(loss("pallas"))(params)
  np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-4)


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.data())
def test_the_interpreter_with_the_kernel_equals_the_reference(program):
  """Invariant 1 with the kernel on: forced PASTA programs on a tiny Gemma 3 whose attention is the Pallas kernel
  (interpreted), against the reference interpreter on the XLA model: same records, logits to float tolerance."""
  from pasta_jax.decode.config import InterpreterConfig
  from pasta_jax.decode.loop import run_interpreter
  from pasta_jax.decode.reference import run_reference
  from pasta_jax.model.gemma import Gemma
  from tests.programs import programs, prompts
  from tests.test_replay import VOCAB, random_params
  cfg, _, params = random_params("tiny-gemma3")
  prog = program.draw(programs(max_segments=4, max_block=8))
  prompt = [t + 200 for t in program.draw(prompts)]  # ordinary text ids of this vocabulary
  script = [[1 if t == 1 else t + 200 if t < 60 else t - 60 + VOCAB.promise for t in thread]  # end id 1 in both
            for thread in prog.script()]
  icfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=128, max_steps=128, record_logits=True)
  pool_spec = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
  got = run_interpreter(Gemma(cfg, attention="pallas").apply, params, [prompt], icfg, vocab_size=cfg.vocab_size,
                        pool_spec=pool_spec, scripts=[script])[0]
  want = run_reference(Gemma(cfg).apply, params, [prompt], VOCAB, lanes=4, max_threads=8, pool_slots=128,
                       max_steps=128, sampling=icfg.sampling, script=[script])[0]
  assert [tuple(r) for r in got.records.tolist()] == [tuple(int(x) for x in r) for r in want.records]
  for row, logits in zip(got.logits, want.logits, strict=True):
    if logits is not None:
      np.testing.assert_allclose(row, logits, atol=1e-4, rtol=1e-5)


def test_unknown_attention_is_refused_by_name():
  from pasta_jax.errors import PastaError
  from pasta_jax.training.config import TrainConfig
  from tests.tiny import tiny_model
  with pytest.raises(PastaError, match="attention must be one of xla, pallas"):
    generate(tiny_model(), ["hi"], Pasta(), runtime=Runtime(attention="flash"))
  with pytest.raises(Exception, match="attention='flash'"):
    TrainConfig(attention="flash")


@pytest.mark.parametrize("splits", [1, 3, None])
def test_gpu_kernel_splits_merge_to_xla(splits):
  """Flash decoding's pool ranges: one range, ranges that do not divide the key blocks (the last one runs short),
  and the default (one block each) all merge to XLA's answer; an MQA layout whose rows need padding to 16."""
  q, k, v, mask, q_pos, kv_pos = random_case(5, batch=1, queries=3, slots=512, heads=4, kv_heads=1)
  spec = AttentionSpec(scale=0.25, softcap=20.0, block_q=4, block_k=64, splits=splits)
  want = attention(q, k, v, mask, q_pos, kv_pos, spec)
  got = attention(q, k, v, mask, q_pos, kv_pos, kernel_spec(spec, "pallas-gpu"))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_gpu_tiling_pads_rows_and_threads_to_powers_of_two_and_refuses_bad_tiles():
  from pasta_jax.model.thread_attention_gpu import Tiling
  decode = Tiling.plan(rows=8 * 4, group=4, threads=6, slots=4096, programs=1, block_q=8, block_k=64, splits=None)
  assert (decode.rows, decode.block_rows, decode.threads, decode.k_blocks, decode.splits) == (32, 32, 8, 64, 64)
  train = Tiling.plan(rows=300, group=1, threads=3, slots=512, programs=2, block_q=8, block_k=128, splits=None)
  assert (train.rows, train.block_rows, train.threads) == (512, 16, 4)
  assert train.splits * train.per_split >= train.k_blocks
  with pytest.raises(ValueError, match="power-of-two block_k"):
    Tiling.plan(rows=8, group=1, threads=2, slots=500, programs=1, block_q=8, block_k=128, splits=None)
