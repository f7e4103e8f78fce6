"""Hypothesis strategies for PASTA tag programs, and helpers to run both interpreters on them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from pasta_jax.decode import loop
from pasta_jax.decode.sampling import RowSampling, SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply
from pasta_jax.lang.tags import TagVocab

VOCAB_SIZE = 128
VOCAB = TagVocab.from_base(60, eos_ids=(1,))
PLAIN_TOKENS = st.integers(2, 59)  # ordinary text ids below the tags


@dataclasses.dataclass(frozen=True)
class Program:
  """A scripted answer: main's tokens (with tags, ending in EOS) and each fork's content."""

  main: tuple[int, ...]
  forks: tuple[tuple[int, ...], ...]  # content + ASYNC_END, in promise order

  def script(self) -> list[list[int]]:
    return [list(self.main)] + [list(f) for f in self.forks]


@st.composite
def programs(draw, max_segments: int = 8, max_block: int = 24, eos_before_sync: bool | None = None) -> Program:
  """Random main threads mixing text, promises (with blocks of very different lengths) and syncs."""
  main: list[int] = []
  forks: list[tuple[int, ...]] = []
  for _ in range(draw(st.integers(0, max_segments))):
    kind = draw(st.sampled_from(["text", "promise", "promise", "sync"]))
    if kind == "text":
      main += draw(st.lists(PLAIN_TOKENS, min_size=1, max_size=6))
    elif kind == "promise":
      topic = draw(st.lists(PLAIN_TOKENS, max_size=2))
      main += [VOCAB.promise, *topic, VOCAB.length_token(draw(st.sampled_from([10, 20, 40, 100])))]
      content = draw(st.lists(PLAIN_TOKENS, min_size=1, max_size=max_block))
      end = draw(st.sampled_from([VOCAB.async_close, VOCAB.async_close, 1]))  # EOS in a fork closes it
      forks.append((*content, end))
    else:
      main.append(VOCAB.sync)
  if eos_before_sync is False and forks:
    main.append(VOCAB.sync)
  main += draw(st.lists(PLAIN_TOKENS, max_size=3)) + [1]
  return Program(tuple(main), tuple(forks))


prompts = st.lists(PLAIN_TOKENS, min_size=1, max_size=12)


def run_toy_rows(params, base, rows, batch_prompts, streams=None):
  """One jitted run of `batch_prompts` on the toy model (decode/toy_model.py) under `base` (an InterpreterConfig),
  row i sampling by rows[i] (SamplingConfigs), in the program of the envelope that covers them all -> RunOutputs."""
  cfg = dataclasses.replace(base, sampling=SamplingConfig.covering(rows))
  tokens, lengths = loop.pad_prompts(batch_prompts, cfg.pool_slots)
  script, script_len = loop.pad_scripts(None, len(rows), cfg.max_threads)
  sampling = jax.tree.map(jnp.asarray, RowSampling.of(rows, streams))
  head_dim = ToyConfig(vocab_size=VOCAB_SIZE).head_dim
  final = loop.prefill_and_run(toy_apply, params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(script),
                               jnp.asarray(script_len), sampling, None, cfg=loop.static_config(cfg), forced=False,
                               vocab_size=VOCAB_SIZE, pool_spec=(1, 1, head_dim, jnp.float32))
  return loop.unpack(final, cfg)


def records_of(run) -> list[tuple[int, ...]]:
  """(step, lane, thread, token, position) per record, as plain ints, of a jitted or a reference run."""
  return [tuple(int(x) for x in r) for r in (run.records.tolist() if hasattr(run.records, "tolist") else run.records)]


def same_run_up_to_a_near_tie(got, want) -> bool:
  """Asserts that a jitted run (`loop.RunOutput`) equals the reference's (`ReferenceResult`): the same records,
  steps, stalls and ends. The two compute one model's logits in different layouts (equal up to float rounding), so
  where the reference sampled at a near tie (`ReferenceResult.near_tie`) they may part: there the records must
  agree up to that record's token, and nothing after it is compared. Returns whether they ran to the end together
  (the caller then compares what else it knows)."""
  mine, oracle = records_of(got), records_of(want)
  parted = next((i for i, (a, b) in enumerate(zip(mine, oracle)) if a != b), None)
  if parted is not None and want.near_tie(parted):
    a, b = mine[parted], oracle[parted]
    assert a[:3] + a[4:] == b[:3] + b[4:], (parted, a, b)  # the same lane at the same place, another token
    return False
  assert mine == oracle
  assert (got.steps, got.stalls, got.finished, got.truncated) == (want.steps, want.stalls, want.finished,
                                                                  want.truncated)
  return True
