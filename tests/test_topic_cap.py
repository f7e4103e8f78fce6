"""`SamplingConfig.max_topic_tokens`: a per-row cap on a PASTA promise's topic, after which main may write only a
LENGTH, each cut of a topic the model would have continued counted in `refusals`.

On the toy model (decode/toy_model.py) with LENGTH tokens it rarely picks, so that a topic, once open, runs on to the
end: through the jitted loop every topic of a capped row stops at its cap and the cuts are counted; rows with and
without a cap share one program, each equal to its run alone; the loop equals the reference interpreter (the
oracle) under a cap. Then the plumbing: the method check, `pasta serve`'s field, `pasta generate` and
`bench.learned`.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.decode import loop
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.reference import run_reference
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import ANY_SAMPLING, RowSampling, SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.errors import PastaError
from pasta_jax.methods import Pasta, PastaTrees, Sequential, registry
from pasta_jax.serve import batches
from pasta_jax.serve.protocol import ApiError, CompletionBody, parse_body
from tests.programs import VOCAB, VOCAB_SIZE, prompts, records_of, run_toy_rows, same_run_up_to_a_near_tie
from tests.test_cli import assert_one_line_error, run_cli

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
# Promises open often and LENGTH tokens are unlikely: uncapped, a topic runs on for many tokens.
PARAMS = toy_params(TOY, {VOCAB.promise: 2.5, VOCAB.async_close: 3.0, VOCAB.sync: 1.0,
                          **{t: -1.0 for t in VOCAB.lengths}}, seed=1)
BASE = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=96, max_steps=40)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [20, 21], [30, 31, 32], [40], [44, 45], [50, 51, 52]]


def run_rows(rows: list[SamplingConfig], batch_prompts=PROMPTS, streams=None) -> list[loop.RunOutput]:
  return run_toy_rows(PARAMS, BASE, rows, batch_prompts, streams)


def topics(out: loop.RunOutput) -> tuple[list[int], int | None]:
  """Main's closed topics' lengths, and the open one's (None when none is open at the end)."""
  closed, current = [], None
  for token in out.records[out.records[:, 2] == 0, 3].tolist():
    if token == VOCAB.promise:
      current = 0
    elif current is not None and token in VOCAB.lengths:
      closed, current = [*closed, current], None
    elif current is not None:
      current += 1
  return closed, current


def test_uncapped_topics_run_on_and_a_cap_closes_each_at_its_length_counting_the_cuts():
  """Greedy, every prompt: without a cap topics run past 3 tokens (most never close); with cap 1 or 3 every topic
  has at most that many tokens, each topic closed at the cap counts one refusal, and the rows fork."""
  plain = run_rows([SamplingConfig()] * len(PROMPTS))
  assert sum(max([*topics(o)[0], topics(o)[1] or 0]) > 3 for o in plain) >= len(PROMPTS) // 2
  assert all(o.refusals == 0 for o in plain)
  for cap in (1, 3):
    capped = run_rows([SamplingConfig(max_topic_tokens=cap)] * len(PROMPTS))
    for out in capped:
      closed, current = topics(out)
      assert all(n <= cap for n in [*closed, current or 0]), (cap, closed, current)
      assert out.refusals == sum(n == cap for n in closed), (cap, closed, out.refusals)  # the model always went on
    assert sum(o.refusals for o in capped) > 0
    assert sum(int(o.records[:, 2].max()) > 0 for o in capped) > sum(int(o.records[:, 2].max()) > 0 for o in plain)


def test_rows_with_and_without_a_cap_share_one_program_and_each_equals_its_run_alone():
  caps = [0, 1, 2, 0, 5, 3, 0, 1]
  rows = [SamplingConfig(temperature=0.9 * (i % 2), seed=7, max_topic_tokens=c) for i, c in enumerate(caps)]
  mixed = run_rows(rows)
  compiled = loop.prefill_and_run._cache_size()
  run_rows([dataclasses.replace(r, max_topic_tokens=c) for r, c in zip(rows, [4, 2, 0, 1, 1, 6, 2, 3])])
  assert loop.prefill_and_run._cache_size() == compiled  # other caps, the same program
  for i, row in enumerate(rows):
    [alone] = run_rows([row], [PROMPTS[i]], streams=[i])
    assert records_of(mixed[i]) == records_of(alone) and mixed[i].refusals == alone.refusals, (i, row)
  assert SamplingConfig(max_topic_tokens=0).envelope() == SamplingConfig().envelope()
  assert SamplingConfig(max_topic_tokens=2).envelope() == SamplingConfig(max_topic_tokens=9).envelope()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.0, 1.0]), cap=st.sampled_from([1, 2, 4]), distinct=st.booleans())
def test_interpreter_matches_reference_under_a_cap(prompt_batch, seed, temperature, cap, distinct):
  """The reference (the oracle) caps and counts as the step does: the same records and the same refusals, with or
  without distinct_topics (which the cap outranks)."""
  sampling = SamplingConfig(temperature=temperature, seed=seed, max_topic_tokens=cap, distinct_topics=distinct)
  cfg = dataclasses.replace(BASE, sampling=sampling)
  got = loop.run_interpreter(toy_apply, PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  want = run_reference(toy_apply, PARAMS, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                       pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling)
  for g, w in zip(got, want, strict=True):
    if same_run_up_to_a_near_tie(g, w):
      assert g.refusals == w.refusals


# --- the plumbing ------------------------------------------------------------------------------------------------
def test_the_value_is_checked_and_travels_per_row():
  for bad in (-1, 1 << 16):
    with pytest.raises(ValueError, match="max_topic_tokens"):
      SamplingConfig(max_topic_tokens=bad)
  rows = RowSampling.of([SamplingConfig(max_topic_tokens=12), SamplingConfig()])
  assert rows.max_topic.tolist() == [12, 0]
  assert ANY_SAMPLING.covers(SamplingConfig(max_topic_tokens=3)) and not SamplingConfig().covers(
      SamplingConfig(max_topic_tokens=3))


def test_only_a_method_that_caps_topics_takes_a_cap():
  runtime = Runtime()
  capped = SamplingConfig(max_topic_tokens=8)
  for name, kind in registry.METHODS.items():
    if kind.capabilities.topic_cap:
      kind().check_request(sampling=capped, runtime=runtime, forced=False)
      continue
    with pytest.raises(PastaError, match=rf"max_topic_tokens=8.*method={re.escape(repr(name))}"):
      kind().check_request(sampling=capped, runtime=runtime, forced=False)
  assert registry.METHODS["pasta"] is Pasta and not PastaTrees.capabilities.topic_cap
  keys = {batches.batch_key(Pasta(), SamplingConfig(max_topic_tokens=c), False) for c in (0, 4, 16)}
  assert len(keys) == 1 and keys.pop().envelope.caps_topics
  assert not batches.batch_key(Sequential(), SamplingConfig(), False).envelope.caps_topics


def test_the_server_protocol_takes_the_field_strictly():
  body = parse_body(CompletionBody, {"prompt": "hi", "max_topic_tokens": 12})
  assert body.max_topic_tokens == 12
  assert parse_body(CompletionBody, {"prompt": "hi"}).max_topic_tokens == 0
  for value in ("12", -1, 1.5, True, 70000):
    with pytest.raises(ApiError, match="max_topic_tokens"):
      parse_body(CompletionBody, {"prompt": "hi", "max_topic_tokens": value})
  with pytest.raises(ApiError, match="max_topic_tokens.*'sequential'"):
    parse_body(CompletionBody, {"prompt": "hi", "max_topic_tokens": 4, "method": "sequential"})


def test_pasta_generate_and_bench_learned_take_it():
  from bench import learned
  from pasta_jax.cli import build_parser
  from pasta_jax.commands.generate import _sampling
  assert _sampling(build_parser().parse_args(["generate", "hi", "--max-topic-tokens", "12"])).max_topic_tokens == 12
  assert _sampling(build_parser().parse_args(["generate", "hi"])).max_topic_tokens == 0
  assert_one_line_error(run_cli("generate", "hi", "--method", "sequential", "--max-topic-tokens", "4"),
                        "max_topic_tokens", "'sequential'")
  assert learned.parse_args(["--max-topic-tokens", "16"]).max_topic_tokens == 16
  assert learned.method_name(None, 4.0, 16) != learned.method_name(None, 4.0, 0) == learned.method_name(None, 4.0)


def test_the_server_hands_the_field_to_the_request_sampling():
  import httpx

  from tests.test_serve_http import KEY, post, serving
  with serving() as (url, engine, _), httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                    timeout=10) as client:
    assert post(client, {"prompt": "hi", "max_topic_tokens": 12, "fork_bias": 4}).status_code == 200
    assert engine.submitted[-1].sampling == SamplingConfig(fork_bias=4.0, max_topic_tokens=12)
    assert post(client, {"prompt": "hi"}).status_code == 200 and not engine.submitted[-1].sampling.caps_topics


def test_pasta_generate_and_the_server_say_what_the_cap_cut():
  import types

  from pasta_jax.commands.pasta_view import summary
  from pasta_jax.decode.result import Result
  from pasta_jax.serve.requests import Update
  from pasta_jax.serve.shapes import Shape
  [out] = run_rows([SamplingConfig(max_topic_tokens=1)], [PROMPTS[0]])
  result = Result(text="", annotated="", records=out.records, threads=(), sync_steps=(), steps=out.steps, stalls=0,
                  finished=out.finished, truncated=out.truncated, theoretical_speedup=1.0,
                  theoretical_parallelism=1.0, seconds=1.0, tokens=1, content_tokens=1, refusals=out.refusals,
                  refused="topics cut at their cap (max_topic_tokens)")
  assert out.refusals > 0 and f"; {out.refusals} topics cut at their cap (max_topic_tokens);" in summary(result, 0.0)
  assert "cut at their cap" not in summary(dataclasses.replace(result, refusals=0), 0.0)
  shape = Shape(types.SimpleNamespace(method=Pasta()), "pasta", chat=False, trace=False, prompt_tokens=3,
                stream_usage=False)
  extras = shape.extras(Update(delta="", done=True, result=result))
  assert (extras["refusals"], extras["refused"]) == (out.refusals, "topics cut at their cap (max_topic_tokens)")
  assert "refusals" not in shape.extras(Update(delta="", done=True, result=dataclasses.replace(result, refusals=0)))
