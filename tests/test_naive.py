"""The naive batched interpreter (Appendix B) against the interleaved one.

Steps differ by design (a naive fork starts one step after its spawn), so the comparisons are per
thread: the same tokens at the same positions, and with a real model the same logits, which only
holds if the prefix copy at spawn and the fork copy back into main's row are right.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import RunOutput, run_interpreter
from pasta_jax.decode.naive import interleaved_kv_bytes, naive_kv_bytes, run_naive
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.config import get_config
from pasta_jax.model.gemma import Gemma, KVPool

VOCAB = TagVocab.from_base(60, (1,))
EOS = 1
P, AE, SYNC = VOCAB.promise, VOCAB.async_close, VOCAB.sync
L10, L20 = VOCAB.length_token(10), VOCAB.length_token(20)
TOY = ToyConfig()
TOY_SPEC = (TOY.num_layers, TOY.num_kv_heads, TOY.head_dim, jnp.float32)

# Per request: [main script (from its first token), fork 1 script, fork 2 script, ...].
PROGRAMS = {
    "back_to_back": [[5, P, 7, L10, P, 8, L20, 9, SYNC, 10, EOS], [20, 21, 22, AE], [30, 31, AE]],
    "sync_while_fork_runs": [[5, P, 7, L10, SYNC, 11, EOS], [20, 21, 22, 23, 24, 25, AE]],
    "eos_before_sync": [[5, P, 7, L10, 8, EOS], [20, 21, 22, 23, EOS]],  # fork ends on an end id
    "more_promises_than_lanes": [[P, 7, L10, P, 8, L10, P, 9, L10, 12, SYNC, 13, EOS],
                                 [20, 21, 22, 23, 24, AE], [30, 31, 32, 33, AE], [40, AE]],
    # Fork 1 closes before fork 2 spawns on its lane: its tokens wait in main's row, hidden from
    # fork 2, until the first sync; fork 3 (after it) sees forks 1 and 2.
    "lane_reuse_before_sync": [[P, 7, L10, 8, 9, 10, P, 13, L10, 14, SYNC, 15, P, 16, L10, 17, SYNC, 18, EOS],
                               [20, AE], [30, 31, AE], [40, 41, 42, AE]],
    "truncated": [[5, P, 7, L10, SYNC, EOS], list(range(10, 58)) * 2 + [AE]],  # > 64 slots in all
}
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17], [18, 19, 20]]
NAMES = list(PROGRAMS)


def config(**kw) -> InterpreterConfig:
  base = dict(vocab=VOCAB, lanes=3, max_threads=8, pool_slots=64, max_steps=96, record_logits=True)
  return InterpreterConfig(**{**base, **kw})


def per_thread(out: RunOutput) -> dict[int, np.ndarray]:
  """thread -> [N, 2] (token, position) in record order."""
  threads = out.records[:, 2]
  return {int(u): out.records[threads == u][:, 3:] for u in np.unique(threads)}


def per_thread_logits(out: RunOutput) -> dict[int, np.ndarray]:
  threads = out.records[:, 2]
  return {int(u): out.logits[threads == u] for u in np.unique(threads)}


def assert_same_threads(ref: RunOutput, naive: RunOutput, name: str):
  ref_t, naive_t = per_thread(ref), per_thread(naive)
  assert ref_t.keys() == naive_t.keys(), name
  for u in ref_t:
    np.testing.assert_array_equal(naive_t[u], ref_t[u], err_msg=f"{name}: thread {u}")


def assert_prefixes(ref: RunOutput, naive: RunOutput, name: str):
  """Truncated runs stop at different steps; each thread's records are a prefix of the other's."""
  ref_t, naive_t = per_thread(ref), per_thread(naive)
  for u in ref_t.keys() | naive_t.keys():
    a, b = ref_t.get(u, np.zeros((0, 2))), naive_t.get(u, np.zeros((0, 2)))
    n = min(len(a), len(b))
    np.testing.assert_array_equal(a[:n], b[:n], err_msg=f"{name}: thread {u}")


@functools.cache
def toy_runs(position_mode: str):
  cfg = config(position_mode=position_mode)
  params = toy_params(TOY, {})
  scripts = [PROGRAMS[n] for n in NAMES]
  kw = dict(vocab_size=TOY.vocab_size, pool_spec=TOY_SPEC, scripts=scripts)
  ref = run_interpreter(toy_apply, params, PROMPTS, cfg, **kw)
  return ref, run_naive(toy_apply, params, PROMPTS, cfg, **kw), cfg


@pytest.mark.parametrize("position_mode", ["pred", "oracle"])
def test_forced_scripts_same_threads_as_interleaved(position_mode):
  ref, naive, _ = toy_runs(position_mode)
  for name, r, n in zip(NAMES, ref, naive, strict=True):
    if name == "truncated":
      continue
    assert r.finished and n.finished and not n.truncated, name
    assert_same_threads(r, n, name)
    for u, logits in per_thread_logits(r).items():  # the toy's logits see the mask too
      np.testing.assert_allclose(per_thread_logits(n)[u], logits, atol=1e-5, err_msg=f"{name}: thread {u}")


def test_forks_start_one_step_later():
  ref, naive, _ = toy_runs("pred")
  for out, delay in ((ref, 0), (naive, 1)):
    for r in out[: NAMES.index("truncated")]:
      for u in set(r.records[:, 2].tolist()) - {0}:
        rows = r.records[r.records[:, 2] == u]
        assert rows[0, 3] == VOCAB.async_open
        assert rows[1, 0] == rows[0, 0] + delay  # first sampled fork token


def test_stalls_when_promises_outnumber_lanes():
  ref, naive, _ = toy_runs("pred")
  i = NAMES.index("more_promises_than_lanes")
  assert naive[i].stalls >= ref[i].stalls > 0  # naive lanes free one step later
  assert naive[i].steps > ref[i].steps


def test_truncation_keeps_every_record():
  ref, naive, cfg = toy_runs("pred")
  i = NAMES.index("truncated")
  assert naive[i].truncated and not naive[i].finished and ref[i].truncated
  assert len(naive[i].records) <= cfg.max_records
  assert_prefixes(ref[i], naive[i], "truncated")
  fork = per_thread(naive[i])[1]
  assert len(fork) > 20  # it ran until the pool (counted as in the interleaved pool) was full


def test_greedy_tag_programs_match():
  """Unforced greedy decoding with tag-biased toy logits: constraints and copies on real programs."""
  bias = {P: 3.0, SYNC: 2.0, EOS: 1.0, AE: 3.0, VOCAB.lengths[0]: 6.0, VOCAB.lengths[1]: 5.0}
  params = toy_params(TOY, bias, seed=1)
  cfg = config(pool_slots=128, max_steps=128, record_logits=False)
  prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [40, 41, 42, 43]]
  kw = dict(vocab_size=TOY.vocab_size, pool_spec=TOY_SPEC)
  ref = run_interpreter(toy_apply, params, prompts, cfg, **kw)
  naive = run_naive(toy_apply, params, prompts, cfg, **kw)
  assert sum(len(per_thread(n)) - 1 for n in naive) >= 6  # the programs do fork
  for i, (r, n) in enumerate(zip(ref, naive, strict=True)):
    if r.finished and n.finished:
      assert_same_threads(r, n, f"prompt {i}")
    else:
      assert_prefixes(r, n, f"prompt {i}")


def test_sampled_run_respects_the_contract():
  bias = {P: 3.0, SYNC: 2.0, EOS: 1.0, AE: 3.0, VOCAB.lengths[0]: 6.0}
  sampling = SamplingConfig(temperature=1.0, seed=8)  # a seed whose runs fork and finish
  cfg = config(pool_slots=128, max_steps=128, record_logits=False, sampling=sampling)
  params = toy_params(TOY, bias, seed=2)
  outs = run_naive(toy_apply, params, [[3, 4, 5], [6, 7]], cfg, vocab_size=TOY.vocab_size, pool_spec=TOY_SPEC)
  assert sum(len(per_thread(out)) - 1 for out in outs) >= 2  # some forks ran
  for out in outs:
    main = out.records[out.records[:, 2] == 0]
    lengths = main[np.isin(main[:, 3], VOCAB.lengths)]
    assert not np.isin(main[:, 3], [VOCAB.async_open, AE]).any()
    for u in range(1, len(lengths) + 1):  # each fork: <async> at its LENGTH's position + 1, no tags
      fork = out.records[out.records[:, 2] == u]
      if len(fork) == 0:
        continue
      assert fork[0, 3] == VOCAB.async_open and fork[0, 4] == lengths[u - 1, 4] + 1
      assert not np.isin(fork[1:, 3], [P, SYNC, VOCAB.async_open, *VOCAB.lengths]).any()
      if out.finished:
        assert fork[-1, 3] == AE


def test_naive_refuses_other_rules():
  from pasta_jax.decode.rules import AparRules
  from pasta_jax.errors import PastaError
  with pytest.raises(PastaError, match="cannot run apar rules"):
    run_naive(toy_apply, toy_params(TOY, {}), PROMPTS[:1], config(rules=AparRules()), vocab_size=TOY.vocab_size,
              pool_spec=TOY_SPEC)
  with pytest.raises(PastaError, match="no repetition penalty"):  # its rows keep no slot tokens to read
    run_naive(toy_apply, toy_params(TOY, {}), PROMPTS[:1], config(sampling=SamplingConfig(repetition_penalty=1.2)),
              vocab_size=TOY.vocab_size, pool_spec=TOY_SPEC)


def test_naive_pool_is_lanes_times_larger():
  gemma = get_config("tiny-gemma3")
  spec = (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, jnp.float32)
  for lanes in (1, 2, 8):
    cfg = config(lanes=lanes, pool_slots=256)
    naive, interleaved = naive_kv_bytes(cfg, 2, spec), interleaved_kv_bytes(cfg, 2, spec)
    assert naive == KVPool.zeros(gemma, 2 * lanes, 256).nbytes() == lanes * interleaved
    assert (naive > interleaved) == (lanes > 1)


def test_tiny_gemma_logits_match_interleaved():
  """Every main and fork token's logits agree: the copies carry exactly the K/V each thread sees."""
  gemma = get_config("tiny-gemma3")
  model = Gemma(gemma)
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(0), tokens, tokens, jnp.ones((1, 4, 4), bool))
  cfg = config(lane_buckets=False)  # one model branch: faster to compile, same semantics
  spec = (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, jnp.float32)
  names = [n for n in NAMES if n != "truncated"]
  kw = dict(vocab_size=gemma.vocab_size, pool_spec=spec, scripts=[PROGRAMS[n] for n in names])
  prompts = PROMPTS[: len(names)]
  ref = run_interpreter(model.apply, params, prompts, cfg, **kw)
  naive = run_naive(model.apply, params, prompts, cfg, **kw)
  for name, r, n in zip(names, ref, naive, strict=True):
    assert r.finished and n.finished, name
    assert_same_threads(r, n, name)
    naive_logits = per_thread_logits(n)
    for u, logits in per_thread_logits(r).items():
      np.testing.assert_allclose(naive_logits[u], logits, atol=1e-4, rtol=0, err_msg=f"{name}: thread {u}")
