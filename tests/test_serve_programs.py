"""The server's guard against the memory-map limit: it reads the real count, drops compiled programs above its
high-water mark (counted, logged), and a server that drops them keeps answering as `generate` does."""

from __future__ import annotations

import queue

import jax
import jax.numpy as jnp

from pasta_jax.serve.programs import ProgramGuard, memory_maps


def test_memory_maps_counts_what_a_new_cpu_program_adds():
  used, limit = memory_maps()
  assert 0 < used < limit
  fresh = jax.jit(lambda x: jnp.tanh(x) @ x.T + jnp.cumsum(x, axis=0))  # a program this process never compiled
  fresh(jnp.ones((37, 37))).block_until_ready()
  after, _ = memory_maps()
  if jax.default_backend() == "cpu":  # its kernels are JIT code in maps of their own
    assert after > used


def test_the_guard_drops_above_its_high_water_mark_and_reads_at_most_every_interval():
  counts = iter([(900, 1000), (100, 1000), (950, 1000)])
  dropped, told = [], []
  guard = ProgramGuard(high_water=0.75, every_s=0.0, read=lambda: next(counts), drop=lambda: dropped.append(1),
                       on_drop=lambda used, limit: told.append((used, limit)))
  assert guard.check() and not guard.check() and guard.check()
  assert guard.drops == 2 == len(dropped) and told == [(900, 1000), (950, 1000)]
  lazy = ProgramGuard(every_s=3600.0, read=lambda: (999, 1000), drop=lambda: dropped.append(1))
  assert lazy.check() and not lazy.check()  # the second read waits an hour
  assert ProgramGuard(read=lambda: (0, 0), drop=lambda: dropped.append(1)).check() is False  # no /proc: nothing


def test_a_server_that_drops_its_programs_answers_as_generate():
  from pasta_jax.serve.engine import Engine, Request, ServeConfig
  from tests.test_serve import MODEL, reference
  engine = Engine(MODEL, ServeConfig(batch=2, pool_slots=256, chunk_steps=4, max_tokens=16))
  counts = iter([(10, 10)] * 2)  # over the limit on the first two turns (before and after the admission), then not
  engine.programs = ProgramGuard(every_s=0.0, read=lambda: next(counts, (0, 10)), on_drop=engine._dropped_programs)
  engine.start()
  try:
    updates: queue.Queue = queue.Queue()
    engine.submit(Request(ids=[2] + [100 + ord(c) for c in "Tea?"], method="sequential", max_tokens=12,
                          sink=updates.put))
    seen = [updates.get(timeout=300)]
    while not seen[-1].done:
      seen.append(updates.get(timeout=300))
    assert "".join(u.delta for u in seen) == reference("Tea?", "sequential", 12, chat=False)
    assert engine.programs.drops == 2 and "pasta_compiled_program_drops_total" in engine.metrics.text().decode()
  finally:
    engine.stop(grace_s=0)
