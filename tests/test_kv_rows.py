"""Deferred K/V writes (`Gemma(..., defer_writes=True)`, model/kv_rows.py): the model that only reads the pool and
returns its new rows, written after the call, computes what the model that writes the pool as it goes computes
(logits and pool), with sliding windows, rows that write nowhere and early pruning; and the compiled decode loop,
with and without a lane-count switch, never copies the pool."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode import api, loop
from pasta_jax.methods import Pasta, Sequential, prepare_run
from pasta_jax.model.gemma import KVPool, RowSelect
from pasta_jax.model.kv_rows import write_fresh
from tests.marks import HEAVY
from tests.tiny import tiny_model

SLOTS = 32
MODELS = {"tiny-gemma2": tiny_model("tiny-gemma2", seed=5), "tiny-gemma3": tiny_model("tiny-gemma3", seed=5)}


def random_call(cfg, batch: int, rows: int, seed: int):
  """A decode call over a pool: random pool contents, dense mask, positions; distinct slots per request, some rows
  writing nowhere (slot S, as padding rows do)."""
  rng = np.random.default_rng(seed)
  pool = KVPool(*(jnp.asarray(rng.normal(size=(cfg.num_layers, batch, SLOTS, cfg.num_kv_heads, cfg.head_dim)),
                              jnp.float32) for _ in range(2)))
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, rows)), jnp.int32)
  positions = jnp.asarray(rng.integers(0, 40, (batch, rows)), jnp.int32)
  mask = jnp.asarray(rng.random((batch, rows, SLOTS)) < 0.6)
  slots = np.stack([rng.permutation(SLOTS)[:rows] for _ in range(batch)])
  slots = np.where(rng.random(slots.shape) < 0.25, SLOTS, slots)
  kv_positions = rng.integers(0, 40, (batch, SLOTS))
  for b, r in zip(*np.nonzero(slots < SLOTS)):  # a row's slot holds its position (the rules write it first)
    kv_positions[b, slots[b, r]] = positions[b, r]
  return tokens, positions, mask, pool, jnp.asarray(slots, jnp.int32), jnp.asarray(kv_positions, jnp.int32)


def both_ways(cfg, params, call, **kw):
  """The model's output with the pool written in place, and with the writes deferred (its kv then written)."""
  apply = api.model_fn(cfg, jnp.float32)
  in_place = apply(params, *call, **kw)
  deferred = apply(params, *call, defer_writes=True, **kw)
  return in_place, dataclasses.replace(deferred, kv=KVPool(*write_fresh(call[3].k, call[3].v, deferred.kv)))


def assert_same(want, got):
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


@settings(max_examples=4, deadline=None)  # every (model, batch, rows) shape compiles: keep them few
@given(name=st.sampled_from(sorted(MODELS)), batch=st.sampled_from([1, 2]), rows=st.sampled_from([1, 4]),
       seed=st.integers(0, 1000))
def test_deferred_writes_equal_writing_in_place(name, batch, rows, seed):
  model = MODELS[name]
  cfg = dataclasses.replace(model.config, sliding_window=6)  # windows that bite (positions span 0..40)
  want, got = both_ways(cfg, api.decode_params(model.params, jnp.float32), random_call(cfg, batch, rows, seed))
  assert_same(want, got)


@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 1000))
def test_deferred_writes_equal_writing_in_place_under_early_pruning(seed):
  """Rows cut at layer 1 write only the first layer: their deeper layers' slots stay as they were."""
  model = MODELS["tiny-gemma3"]
  cfg, rows, batch = model.config, 4, 2
  kept = np.random.default_rng(seed).permutation(rows)[:2]
  keep = lambda x, tokens: (jnp.broadcast_to(jnp.asarray(kept, jnp.int32), (batch, 2)),
                            jnp.asarray([[True, True], [True, False]]))
  select = RowSelect(layer=1, keep=2, choose=keep)
  call = random_call(cfg, batch, rows, seed)
  want, got = both_ways(cfg, api.decode_params(model.params, jnp.float32), call, row_select=select)
  assert_same(want, got)
  cut = np.setdiff1d(np.arange(rows), kept)[0]
  slot = int(call[4][0, cut])
  if slot < SLOTS:  # a row cut: layer 0 written, layer 1 as before
    np.testing.assert_array_equal(np.asarray(got.kv.k[1, 0, slot]), np.asarray(call[3].k[1, 0, slot]))
    assert not np.array_equal(np.asarray(got.kv.k[0, 0, slot]), np.asarray(call[3].k[0, 0, slot]))


def pool_copies(method, **kw) -> list[str]:
  """Copies of the KV pool in the compiled decode loop of the tiny model, other than the entry's initial zeros."""
  model = MODELS["tiny-gemma3"]
  ids = [model.tokenizer.encode("a b c d")] * 2
  prep = prepare_run(model, ids, method, max_new_tokens=8, **kw)
  text = api.COMPILED.get(prep, loop.prefill_and_run).as_text()
  cfg = model.config
  shape = rf"f32\[{cfg.num_layers},2,{prep.cfg.pool_slots},{cfg.num_kv_heads},{cfg.head_dim}\]"
  return [line for line in text.splitlines()
          if re.search(shape + r"\S* copy\(", line) and not re.search(r"copy\(%wrapped_broadcast", line)]


@pytest.mark.production_xla
def test_the_decode_loop_never_copies_the_pool():
  """PASTA's four lanes run under a lane-count switch (the rows written after it); plain decoding has one
  branch (the model writes as it goes). Either way the step updates the loop's pool in place: a write inside the
  switch, or after the reads without one, shows here as copies (measured: a ProPD step at batch 8 1.16x a plain
  one on a 2-core CPU, from 150 MB of copies a step)."""
  assert pool_copies(Pasta(lanes=4)) == []
  assert pool_copies(Sequential()) == []


@pytest.mark.production_xla
@HEAVY  # an HLO inspection; test_the_decode_loop_never_copies_the_pool holds the default's rule
def test_writing_in_the_branch_copies_the_pool_on_a_cpu_and_is_the_default_elsewhere(monkeypatch):
  """The setting is honoured: written inside the switch, the CPU loop copies the pool (what deferring removes).
  Off a CPU writing in the branch is the default (an H100 measured a one-lane step 1.11x plain decoding written in
  the branch, 1.73x deferred: bench.seq_cost --defer off,on)."""
  assert pool_copies(Pasta(lanes=4), defer_kv_writes=False) != []
  model = MODELS["tiny-gemma3"]
  prepare = lambda: prepare_run(model, [model.tokenizer.encode("a b")], Pasta(), max_new_tokens=8)
  assert prepare().cfg.defer_kv_writes is True
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert prepare().cfg.defer_kv_writes is False
