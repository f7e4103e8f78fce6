"""ProPD served: its step-time model is measured online from the server's chunks (`serve/propd.py`)."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from pasta_jax.decode import speculation
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.methods import Propd, Sequential, generate_ids
from pasta_jax.serve.batches import batch_key
from pasta_jax.serve.engine import Engine, Request, ServeConfig
from pasta_jax.serve.propd import PINNED_ELSEWHERE, OnlineLatency
from tests.test_serve import HEADS, MODEL

SIZES = (1, 2, 4)


def step_time(size: int) -> float:
  """A made-up device: T(s) = alpha s + beta for trees; the root alone is a plain step, cheaper (no heads)."""
  return 0.04 if size == 1 else 0.003 * size + 0.05


def test_online_latency_pins_each_size_then_fits():
  latency = OnlineLatency(SIZES, samples=2)
  first = latency.table(4)
  latency.observe(4, 100.0, 8)  # the compiling chunk: not a step time
  pinned = []
  assert latency.calibrating(4) and latency.calibrating(2)  # its chunks must run whole (`Engine.chunk_length`)
  while 4 not in latency.fits():
    table = latency.table(4)
    assert sorted(table) == [1.0] + [PINNED_ELSEWHERE] * (len(SIZES) - 1)  # one size may be chosen
    size = SIZES[int(np.argmin(table))]
    pinned.append(size)
    latency.observe(4, step_time(size) * 8, 8)
    latency.observe(4, 1.0, 0) if len(pinned) == 1 else None  # a chunk that advanced no step counts nothing
    assert len(pinned) <= 2 * len(SIZES) + 1
  assert SIZES[int(np.argmin(first))] == pinned[0] and sorted(pinned) == [1, 1, 2, 2, 4, 4]
  alpha, beta = latency.fits()[4]
  assert alpha == pytest.approx(0.003) and beta == pytest.approx(0.05)
  np.testing.assert_allclose(latency.table(4), [step_time(s) for s in SIZES])
  assert not latency.calibrating(4) and latency.calibrating(2)
  assert 2 not in latency.fits() and sorted(latency.table(2)).count(1.0) == 1  # each rows bucket on its own


def test_the_engine_calibrates_propd_while_it_serves():
  """One request is enough to time every size (one sample each) in its rows bucket; the answer stays plain
  greedy decoding's, and the fit shows in /metrics."""
  cfg = ServeConfig(batch=2, pool_slots=256, chunk_steps=2, max_tokens=32,
                    methods=(Propd(heads=HEADS, tree_size=4),), propd_samples=1)
  engine = Engine(MODEL, cfg).start()
  updates: queue.Queue = queue.Queue()
  ids = MODEL.tokenizer.encode("Tell me a tea.", add_bos=True)
  try:
    engine.submit(Request(ids=ids, method="propd", max_tokens=32, sink=updates.put))
    got = [updates.get(timeout=300)]
    while not got[-1].done:
      got.append(updates.get(timeout=300))
    fits = [b.latency.fits() for b in list(engine.batches.values()) if b.latency is not None]
  finally:
    engine.stop(grace_s=0)
  want = generate_ids(MODEL, [ids], Sequential(), max_new_tokens=32)[0].text
  assert "".join(u.delta for u in got) == want
  assert len(fits) == 1 and 1 in fits[0]
  assert 'pasta_propd_step_seconds{coefficient="beta",rows="1"}' in engine.metrics.text().decode()


@pytest.mark.parametrize("tree_size,want", [(None, speculation.SERVED_PROPD_TREE), (4, 4)])
def test_a_served_propd_compiles_a_small_tree_unless_told(tree_size, want):
  """The server has no calibration run to size ProPD's compiled tree, and its online model times every size."""
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, max_tokens=32,
                                     methods=(Propd(heads=HEADS, tree_size=tree_size),)))
  entry = engine._batch_for(batch_key(engine.method_named("propd"), SamplingConfig(), certify_head=False))
  assert entry.prep.cfg.rules.tree.size == want
  assert entry.latency.sizes == tuple(s for s in (1, 2, 4, 8) if s <= want)
