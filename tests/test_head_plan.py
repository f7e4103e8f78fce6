"""The output head's form per row count (model/head_plan.py): chosen from timings with a margin against noise,
measured on a CPU unless pinned, and every form computes the same head, certified or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode import api, certified_head
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.methods import Pasta, generate
from pasta_jax.model import head_timing
from pasta_jax.model.gemma import output_head
from pasta_jax.model.head_plan import FIXED, HeadPlan, choose, describe
from tests.tiny import tiny_model

PROMPTS = ["hello there", "list three colours"]


def timings(**ms) -> dict:
  """{(rows, form): seconds} from keywords like wm2=36, tm2=63, nw2=31 (ms)."""
  forms = {"wm": "weight_major", "tm": "token_major", "nw": "narrow"}
  return {(int(key[2:]), forms[key[:2]]): value / 1e3 for key, value in ms.items()}


def test_a_form_replaces_the_fixed_one_only_when_clearly_faster():
  # 2 rows: token-major is fixed and clearly slower -> weight-major; 3 rows: weight-major 5% faster, within the
  # margin -> stays token-major; 4 rows: weight-major is fixed, token-major 20% faster -> token-major.
  plan = choose(timings(wm2=36, tm2=63, wm3=38, tm3=40, wm4=50, tm4=40), narrow=False)
  assert plan.token_major == (3, 4)
  assert plan.exact == (1,)
  assert dict(plan.measured)["2:token_major"] == 63.0


def test_a_certified_head_goes_exact_where_the_narrow_head_is_no_faster():
  plan = choose(timings(wm2=36, tm2=63, nw2=31, wm4=34, tm4=64, nw4=38, wm8=44, tm8=67, nw8=44), narrow=True)
  assert plan.exact == (1, 4, 8)  # 8 rows: a tie goes exact (the certificate would cost more)
  assert plan.token_major == (3,)  # 3 rows were not measured: the fixed plan's form
  # 3 rows: the narrow product 5% faster than the fastest float32 form, within the margin: the certificate's own
  # work would eat it.
  assert choose(timings(wm3=40, tm3=38, nw3=36.2), narrow=True).exact == (1, 3)


def test_rows_above_every_measured_count_follow_the_largest():
  """A batch of 16 rows, or a tree of 32, was never timed: it takes float32 when the largest timed count did."""
  slow_at_8 = choose(timings(wm2=36, tm2=63, nw2=24, wm8=44, tm8=67, nw8=56), narrow=True)
  assert [r for r in (1, 2, 3, 8, 16, 64) if slow_at_8.exact_at(r)] == [1, 8, 16, 64]
  fast_at_8 = choose(timings(wm2=36, tm2=63, nw2=24, wm8=44, tm8=67, nw8=30), narrow=True)
  assert [r for r in (1, 2, 8, 16, 64) if fast_at_8.exact_at(r)] == [1]
  assert not HeadPlan().exact_at(16)  # the fixed plan measured nothing: only its own exact rows


def test_the_plan_says_where_a_certified_head_skips_its_certificate():
  plan = choose(timings(wm2=32, tm2=60, nw2=50, wm4=35, tm4=62, nw4=30), narrow=True)
  line = describe(plan, narrow=True)
  assert "no certificate, at rows 1, 2;" in line  # 4 rows: the narrow copy is faster there
  assert "2:narrow 50 ms" in line and "4:weight_major 35 ms" in line
  assert "certificate" not in describe(plan, narrow=False)
  assert "token-major at rows none; timed: none (the fixed plan)" in describe(HeadPlan(token_major=()), False)


def test_pasta_generate_says_what_its_certified_head_runs(monkeypatch, capsys):
  from pasta_jax import cli
  from pasta_jax.commands import generate

  model = tiny_model()
  monkeypatch.setattr(generate, "load_model", lambda _: model)
  plan = HeadPlan(token_major=(), exact=(1, 2), measured=(("2:narrow", 9.0),))
  monkeypatch.setattr(api, "head_plan", lambda *args: plan)
  args = cli.build_parser().parse_args(["generate", "hi", "--certify-head", "--max-new-tokens", "2", "--no-chat"])
  assert generate.run_generate(args) == 0
  # 2 rows, the largest timed, went exact: so do the rows above it
  assert "float32 head, no certificate, at rows 1, 2 and above; token-major at rows none; timed: 2:narrow 9 ms" in (
      capsys.readouterr().err)


def test_without_a_narrow_head_nothing_goes_exact():
  assert choose(timings(wm2=36, tm2=63), narrow=False).exact == FIXED.exact


def test_the_plan_is_fixed_when_pinned_and_refuses_other_settings(monkeypatch):
  head_timing.measured_plan.cache_clear()
  monkeypatch.setenv(head_timing.ENV, "fixed")
  assert head_timing.measured_plan(64, 16, "float32", None) == FIXED
  monkeypatch.setenv(head_timing.ENV, "fastest")
  head_timing.measured_plan.cache_clear()
  with pytest.raises(ValueError, match="PASTA_HEAD_PLAN"):
    head_timing.measured_plan(64, 16, "float32", None)
  head_timing.measured_plan.cache_clear()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the plan is measured on a CPU backend only")
def test_a_measured_plan_times_every_form_at_every_measured_row_count(monkeypatch):
  monkeypatch.setenv(head_timing.ENV, "measured")
  head_timing.measured_plan.cache_clear()
  plan = head_timing.measured_plan(512, 32, "float32", "bfloat16")
  head_timing.measured_plan.cache_clear()
  measured = dict(plan.measured)
  assert set(measured) == {f"{r}:{f}" for r in head_timing.MEASURED_ROWS for f in ("weight_major", "token_major",
                                                                                   "narrow")}
  assert all(ms > 0 for ms in measured.values())
  assert 1 in plan.exact and set(plan.token_major) <= set(FIXED.token_major) | set(head_timing.MEASURED_ROWS)


@pytest.mark.parametrize("plan", [HeadPlan(token_major=()), HeadPlan(token_major=(1, 2, 3, 4, 5, 6))])
@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 2), (1, 3), (2, 2), (1, 5)])
def test_every_plan_computes_the_same_head(plan, batch, rows):
  rng = np.random.default_rng(batch * 10 + rows)
  x = jnp.asarray(rng.normal(size=(batch, rows, 16)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
  want = np.einsum("bqd,vd->bqv", np.asarray(x, np.float64), np.asarray(unembed, np.float64))
  np.testing.assert_allclose(output_head(x, unembed, True, plan), want, atol=1e-4, rtol=1e-4)


def test_certified_decoding_with_exact_row_counts_writes_the_float32_tokens(monkeypatch):
  """A plan that sends every row count of a batch of two (2 to 16 rows) to the float32 head: the narrow head and
  its certificate never run, and greedy decoding still writes the float32 model's tokens."""
  plan = HeadPlan(token_major=(), exact=(1, 2, 4, 8, 16))
  monkeypatch.setattr(api, "measured_plan", lambda *args: plan)

  def no_certificate(*args):
    raise AssertionError("a row count of plan.exact reached the narrow head's certificate")

  monkeypatch.setattr(certified_head, "certified_requests", no_certificate)
  model = tiny_model("tiny-gemma3", seed=3)
  sampling = SamplingConfig(repetition_penalty=1.3)
  plain = generate(model, PROMPTS, Pasta(), max_new_tokens=24, sampling=sampling)
  certified = generate(model, PROMPTS, Pasta(), max_new_tokens=24, sampling=sampling,
                       runtime=Runtime(certify_head=True))
  assert api.model_fn(model.config, jnp.float32).__self__.head_plan == plan  # the decode model is kept per plan
  assert [list(r.records[:, 3]) for r in certified] == [list(r.records[:, 3]) for r in plain]
