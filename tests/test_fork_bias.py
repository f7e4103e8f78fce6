"""`SamplingConfig.fork_bias`: PASTA's decode-time speed/quality knob, a per-row offset on the promise-open logit.

On the toy model (decode/toy_model.py, which writes tags) through the jitted loop: 0 keeps today's program and
records; a large positive bias makes main open promises on prompts where it opened none, a large negative one
suppresses them, and neither reaches a fork or main inside a promise's topic; rows with different biases share one
batch and one compiled program, each equal to its run alone; the loop equals the reference interpreter under a bias.
Then the plumbing: `generate`'s per-prompt configs, the method check, `pasta serve`'s request field, `pasta
generate --fork-bias`, and `bench.learned`'s list of settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pasta_jax.decode import loop
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.reference import run_reference
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import ANY_SAMPLING, RowSampling, SamplingConfig
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.errors import PastaError
from pasta_jax.methods import Pasta, Sequential, registry
from pasta_jax.serve import batches
from pasta_jax.serve.protocol import ApiError, ChatBody, CompletionBody, parse_body
from tests.programs import VOCAB, VOCAB_SIZE, prompts, records_of, run_toy_rows, same_run_up_to_a_near_tie
from tests.test_cli import assert_one_line_error, run_cli
from tests.test_serve_http import KEY, error_of, post, serving

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
POOL_SPEC = (1, 1, TOY.head_dim, jnp.float32)
# Promises are possible but rare: at bias 0, main opens them on two of PROMPTS (greedy).
PARAMS = toy_params(TOY, {VOCAB.promise: 0.5, VOCAB.async_close: 3.0, VOCAB.sync: 1.0, 1: 0.5,
                          **{t: 3.0 for t in VOCAB.lengths[:3]}}, seed=1)
BASE = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=64, max_steps=48)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [20, 21], [30, 31, 32], [40], [44, 45], [50, 51, 52]]
BIG = 20.0  # far past the toy's logit gaps: a promise wherever one may open, or none


def run_rows(rows: list[SamplingConfig], batch_prompts=PROMPTS, streams=None) -> list[loop.RunOutput]:
  """One jitted run of `batch_prompts`, row i sampling by rows[i], under the envelope that covers them all."""
  return run_toy_rows(PARAMS, BASE, rows, batch_prompts, streams)


def main_tokens(out: loop.RunOutput) -> list[int]:
  return out.records[out.records[:, 2] == 0, 3].tolist()


def main_promises(out: loop.RunOutput) -> int:
  return main_tokens(out).count(VOCAB.promise)


# --- the knob on device -------------------------------------------------------------------------------------------
def test_zero_is_todays_program_and_a_zero_row_keeps_todays_records():
  """0 (and -0) compiles today's program; rows at 0 inside a program with the bias path (other rows biased, greedy
  and sampled alike) record exactly what today's program records for them."""
  assert SamplingConfig(fork_bias=0.0).envelope() == SamplingConfig().envelope()
  assert SamplingConfig(fork_bias=-0.0).envelope() == SamplingConfig().envelope()
  assert SamplingConfig(fork_bias=-3.0).envelope() == SamplingConfig(fork_bias=5.0).envelope() != SamplingConfig()
  biases = [0.0, 3.0, 0.0, -3.0, 0.0, 8.0, 0.0, -8.0]
  mixed = [SamplingConfig(temperature=float(i % 2), seed=11, fork_bias=b) for i, b in enumerate(biases)]
  today = [dataclasses.replace(row, fork_bias=0.0) for row in mixed]
  got, want = run_rows(mixed), run_rows(today)
  for i, bias in enumerate(biases):
    if bias == 0:
      assert records_of(got[i]) == records_of(want[i]), i
      assert (got[i].steps, got[i].finished, got[i].truncated) == (want[i].steps, want[i].finished, want[i].truncated)
  assert any(records_of(got[i]) != records_of(want[i]) for i, b in enumerate(biases) if b)  # the others did move


def test_a_positive_bias_opens_promises_and_a_negative_one_suppresses_them():
  """Greedy: at 0 main opens promises on some prompts only; at +BIG on every prompt, at -BIG on none. The bias
  counts only where a promise may open: no fork and no main inside a topic ever writes PROMISE."""
  plain = run_rows([SamplingConfig()] * len(PROMPTS))
  more = run_rows([SamplingConfig(fork_bias=BIG)] * len(PROMPTS))
  fewer = run_rows([SamplingConfig(fork_bias=-BIG)] * len(PROMPTS))
  assert 0 < sum(main_promises(o) > 0 for o in plain) < len(PROMPTS)
  assert all(main_promises(o) > 0 for o in more)
  assert all(o.records[:, 2].max() > 0 for o in more)  # and they fork
  assert sum(map(main_promises, fewer)) == 0 and all(o.records[:, 2].max() == 0 for o in fewer)
  for out in more:
    assert not np.any((out.records[:, 2] > 0) & (out.records[:, 3] == VOCAB.promise))  # forks never promise
    main, inside = main_tokens(out), False
    for token in main:  # a promise opens only outside one: its topic ends at a LENGTH before the next PROMISE
      assert not (inside and token == VOCAB.promise), main
      inside = token == VOCAB.promise or (inside and token not in VOCAB.lengths)


def test_rows_with_different_biases_share_one_program_and_each_equals_its_run_alone():
  """One batch of rows at -BIG, 0, 2 and +BIG (greedy and sampled): one compiled program, which a batch with other
  values reuses (the compile count does not move), and each row records what it records alone (batch of one, its
  own stream)."""
  biases = [-BIG, 0.0, 2.0, BIG, 2.0, -BIG, BIG, 0.0]
  rows = [SamplingConfig(temperature=0.8 * (i % 2), seed=5, fork_bias=b) for i, b in enumerate(biases)]
  mixed = run_rows(rows)
  compiled = loop.prefill_and_run._cache_size()
  shuffled = [dataclasses.replace(r, fork_bias=b) for r, b in zip(rows, [4.0, -1.5, BIG, 0.5, -BIG, 0.0, 7.0, 1.0])]
  run_rows(shuffled)
  assert loop.prefill_and_run._cache_size() == compiled  # new values, the same program
  assert loop.static_config(dataclasses.replace(BASE, sampling=SamplingConfig.covering(rows))) == \
      loop.static_config(dataclasses.replace(BASE, sampling=SamplingConfig.covering(shuffled)))
  for i, row in enumerate(rows):
    [alone] = run_rows([row], [PROMPTS[i]], streams=[i])
    assert records_of(mixed[i]) == records_of(alone), (i, row)
  assert main_promises(mixed[3]) > 0 and main_promises(mixed[0]) == 0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_batch=st.lists(prompts, min_size=2, max_size=2), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.0, 1.0]), fork_bias=st.sampled_from([-2.5, 1.5, 6.0]))
# Here the reference draws at a near tie (its uniform 2e-7 of the mass from a boundary) and the two part there.
@example(prompt_batch=[[2], [25, 9, 28, 55, 6, 4, 42, 45, 16, 39, 30, 2]], seed=97, temperature=1.0, fork_bias=6.0)
def test_interpreter_matches_reference_under_a_bias(prompt_batch, seed, temperature, fork_bias):
  """The reference interpreter (the oracle) adds the bias as the step does: the same records, token for token."""
  cfg = dataclasses.replace(BASE, sampling=SamplingConfig(temperature=temperature, seed=seed, fork_bias=fork_bias))
  got = loop.run_interpreter(toy_apply, PARAMS, prompt_batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
  want = run_reference(toy_apply, PARAMS, prompt_batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                       pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling)
  for g, w in zip(got, want, strict=True):
    same_run_up_to_a_near_tie(g, w)


# --- the plumbing ------------------------------------------------------------------------------------------------
def test_the_value_is_checked_and_travels_per_row():
  with pytest.raises(ValueError, match="fork_bias"):
    SamplingConfig(fork_bias=float("nan"))
  rows = RowSampling.of([SamplingConfig(fork_bias=-2.0), SamplingConfig(), SamplingConfig(fork_bias=7.5)])
  assert rows.fork_bias.tolist() == [-2.0, 0.0, 7.5] and rows.fork_bias.dtype == np.float32
  assert ANY_SAMPLING.covers(SamplingConfig(fork_bias=3.0)) and not SamplingConfig().covers(SamplingConfig(fork_bias=1))


def test_a_method_without_promises_refuses_a_bias_by_name():
  runtime = Runtime()
  for name, kind in registry.METHODS.items():
    if kind.capabilities.promises:
      continue
    with pytest.raises(PastaError, match=rf"fork_bias=2.*method={name!r} opens no promises"):
      kind().check_request(sampling=SamplingConfig(fork_bias=2.0), runtime=runtime, forced=False)
    kind().check_request(sampling=SamplingConfig(), runtime=runtime, forced=False)  # 0 is fine
  Pasta().check_request(sampling=SamplingConfig(fork_bias=-4.0), runtime=runtime, forced=False)


def test_a_served_batch_of_a_method_with_promises_runs_every_bias_in_one_program():
  """The batch (and so the program) of a request does not depend on its bias: a method with promises compiles the
  bias path once for all its rows, one without never does."""
  for certify in (False, True):
    keys = {batches.batch_key(Pasta(), SamplingConfig(fork_bias=b), certify) for b in (0.0, -3.0, 9.5)}
    assert len(keys) == 1 and keys.pop().envelope.biases_forks
  assert not batches.batch_key(Sequential(), SamplingConfig(), False).envelope.biases_forks


@pytest.fixture(scope="module")
def http():
  import httpx
  with serving() as (url, engine, _), httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                                    timeout=10) as client:
    yield client, engine


def test_the_server_takes_the_field_strictly(http):
  """`fork_bias` reaches the request's SamplingConfig; a string, a value out of range, or a method without
  promises is a 400 naming the field."""
  client, engine = http
  assert post(client, {"prompt": "hi", "fork_bias": 2.5}).status_code == 200
  assert engine.submitted[-1].sampling == SamplingConfig(fork_bias=2.5)
  assert post(client, {"prompt": "hi", "fork_bias": -3}).status_code == 200  # an integer is a float
  assert engine.submitted[-1].sampling.fork_bias == -3.0
  assert post(client, {"prompt": "hi"}).status_code == 200 and engine.submitted[-1].sampling.fork_bias == 0.0
  for value in ("2.5", True, 101.0, None):
    assert error_of(post(client, {"prompt": "hi", "fork_bias": value}), 400)["param"] == "fork_bias", value
  refused = error_of(post(client, {"prompt": "hi", "fork_bias": 1.0, "method": "sequential"}), 400)
  assert refused["param"] == "fork_bias" and "'sequential' opens no promises" in refused["message"]
  assert post(client, {"prompt": "hi", "fork_bias": 0, "method": "sequential"}).status_code == 200


def test_the_protocol_parses_it_in_both_bodies():
  chat = parse_body(ChatBody, {"messages": [{"role": "user", "content": "hi"}], "fork_bias": -1.25})
  assert chat.fork_bias == -1.25
  with pytest.raises(ApiError, match="fork_bias"):
    parse_body(CompletionBody, {"prompt": "hi", "fork_bias": "-1"})


def test_pasta_generate_takes_the_flag_and_refuses_it_for_a_method_without_promises():
  from pasta_jax.cli import build_parser
  from pasta_jax.commands.generate import _sampling
  assert _sampling(build_parser().parse_args(["generate", "hi", "--fork-bias", "-3.5"])).fork_bias == -3.5
  assert _sampling(build_parser().parse_args(["generate", "hi"])).fork_bias == 0.0
  # said before any model loads
  assert_one_line_error(run_cli("generate", "hi", "--method", "sequential", "--fork-bias", "2"), "fork_bias",
                        "'sequential'")


def test_bench_learned_gives_each_setting_its_own_row_under_the_shipped_sampling(tmp_path):
  from bench import learned
  assert learned.fork_biases("-2,0,2,4,8") == (-2.0, 0.0, 2.0, 4.0, 8.0)
  assert learned.fork_biases("-0") == (0.0,)
  for bad in ("1,1", "a", "1,nan", ""):
    with pytest.raises(argparse.ArgumentTypeError):
      learned.fork_biases(bad)
  names = [learned.method_name(None, b) for b in (0.0, 4.0, -2.0, 0.5)]
  assert names[0] == "pasta:default" and len(set(names)) == 4  # a resumed folder decodes a new setting afresh
  assert learned.parse_args([]).fork_bias == (0.0,)
  (tmp_path / "generation.json").write_text(json.dumps({"repetition_penalty": 1.1}))
  model = types.SimpleNamespace(source=str(tmp_path))
  penalty, topics, line = learned.shipped_sampling(learned.parse_args([]), model)
  assert (penalty, topics) == (1.1, False) and "generation.json" in line and "1.1" in line
  flags = learned.parse_args(["--repetition-penalty", "1", "--distinct-topics"])
  assert learned.shipped_sampling(flags, model)[:2] == (1.0, True)


def test_the_scoped_form_biases_its_promise_as_its_reference_does():
  """`pasta-v0` (promises=True) applies the bias to its own `<promise/>`, wherever its grammar lets one open, as its
  reference interpreter does; a large negative one leaves it no fork."""
  from pasta_jax.decode.reference.scoped import run_scoped_reference
  from pasta_jax.decode.rules.scoped import ScopedRules
  scoped = toy_params(TOY, {VOCAB.scope_open: 2.0, VOCAB.scope_close: 2.0, VOCAB.bare_promise: 3.0,
                            VOCAB.async_close: 3.0, 1: 0.5}, seed=1)
  batch = [[5, 6, 7], [8, 9]]
  for bias in (-BIG, 2.0):
    cfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=16, pool_slots=64, max_steps=40, rules=ScopedRules(),
                            sampling=SamplingConfig(temperature=1.0, seed=3, fork_bias=bias))
    got = loop.run_interpreter(toy_apply, scoped, batch, cfg, vocab_size=VOCAB_SIZE, pool_spec=POOL_SPEC)
    want = run_scoped_reference(toy_apply, scoped, batch, cfg.vocab, lanes=cfg.lanes, max_threads=cfg.max_threads,
                                pool_slots=cfg.pool_slots, max_steps=cfg.max_steps, sampling=cfg.sampling,
                                max_depth=cfg.rules.max_depth)
    for g, w in zip(got, want, strict=True):
      assert records_of(g) == records_of(w)
    forks = sum(int((o.records[:, 3] == VOCAB.bare_promise).sum()) for o in got)
    assert forks == 0 if bias < 0 else forks > 0
