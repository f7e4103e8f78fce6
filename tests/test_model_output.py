"""The model contract (model/output.py): every call of `Gemma` and of the toy model returns one `ModelOutput`
whose filled fields are exactly the ones the call asked for, with the documented shapes, for every combination
of the flags. Shapes only (`jax.eval_shape`): tracing the call is the contract, and it costs no compile."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest

from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.model.gemma import Gemma, KVPool, RowSelect
from pasta_jax.model.kv_rows import FreshKV
from pasta_jax.model.output import ModelOutput
from tests.tiny import tiny_model

MODEL = tiny_model("tiny-gemma3")
B, Q, S, R, KEEP, LAYER = 2, 4, 16, 2, 2, 1


def requests(with_row_select: bool = True, with_hidden_after: bool = True):
  """Every combination of the call's flags that can be asked together, as (pool, defer, flags)."""
  both, only_off = (False, True), (False,)
  for pool, defer, return_hidden, skip_head, prune, rows, early in itertools.product(
      both, both, both, both, both if with_row_select else only_off, both, both if with_hidden_after else only_off):
    if (defer or prune) and not pool:  # deferred writes and pruning work over a pool
      continue
    if (prune and rows) or (early and (return_hidden or skip_head or prune)):  # refused together
      continue
    yield pool, defer, {"return_hidden": return_hidden, "skip_head": skip_head, "row_select": prune,
                        "logit_rows": rows, "hidden_after": early}


def expected_shapes(cfg, pool: bool, defer: bool, flags: dict) -> dict:
  """field -> shape (kv: the shapes of its arrays) of what the call asked for; fields not listed are None."""
  if flags["hidden_after"]:
    return {"early_hidden": (B, Q, cfg.embed_dim)}
  rows = R if flags["logit_rows"] else Q
  want = {}
  if not flags["skip_head"]:
    want["logits"] = (B, rows, cfg.vocab_size)
  if flags["return_hidden"] or flags["skip_head"]:
    want["head_input"] = (B, rows, cfg.embed_dim)
  if pool:
    kv_rows = (cfg.num_layers, B, Q if defer else S, cfg.num_kv_heads, cfg.head_dim)
    want["kv"] = (kv_rows, kv_rows) + (((cfg.num_layers, B, Q),) if defer else ())
  if flags["row_select"]:
    want["kept"] = (B, Q)
  return want


def call_args(cfg, pool: bool, defer: bool, flags: dict):
  """(positional arguments after params, keyword arguments) of a call asking `flags`."""
  keys = S if pool else Q
  tokens = jnp.arange(B * Q, dtype=jnp.int32).reshape(B, Q) % cfg.vocab_size
  positions = jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32), (B, Q))
  mask = jnp.ones((B, Q, keys), bool)
  args = (tokens, positions, mask)
  if pool:
    kv = KVPool(*(jnp.zeros((cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)),) * 2)
    args += (kv, positions + 3, jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))
  kw = {"defer_writes": defer} if defer else {}
  if flags["return_hidden"]:
    kw["return_hidden"] = True
  if flags["skip_head"]:
    kw["skip_head"] = True
  if flags["logit_rows"]:
    kw["logit_rows"] = jnp.asarray([[1, 3]] * B, jnp.int32)
  if flags["hidden_after"]:
    kw["hidden_after"] = LAYER
  if flags["row_select"]:
    choose = lambda x, tokens: (jnp.asarray([[0, 2]] * B, jnp.int32), jnp.asarray([[True, True], [True, False]]))
    kw["row_select"] = RowSelect(LAYER, KEEP, choose)
  return args, kw


def shapes_of(out: ModelOutput) -> dict:
  """field -> shape of each filled field (kv: the shapes of its arrays, in field order)."""
  shape = lambda value: value.shape if hasattr(value, "shape") else tuple(leaf.shape for leaf in jax.tree.leaves(value))
  return {name: shape(getattr(out, name)) for name in out.present()}


def check(out, want: dict, defer: bool):
  assert isinstance(out, ModelOutput)
  assert shapes_of(out) == want
  if "kv" in want:
    assert isinstance(out.kv, FreshKV if defer else KVPool)
  if out.logits is not None:
    assert out.logits.dtype == jnp.float32
  if out.kept is not None:
    assert out.kept.dtype == jnp.bool_


def label(request) -> str:
  pool, defer, flags = request
  asked = [name for name, on in flags.items() if on]
  return "-".join((["pool"] if pool else []) + (["defer"] if defer else []) + asked) or "plain"


@pytest.mark.parametrize("request_", list(requests()), ids=label)
def test_gemma_returns_exactly_the_fields_asked_for(request_):
  pool, defer, flags = request_
  cfg = MODEL.config
  args, kw = call_args(cfg, pool, defer, flags)
  out = jax.eval_shape(lambda params: Gemma(cfg).apply(params, *args, **kw), MODEL.params)
  check(out, expected_shapes(cfg, pool, defer, flags), defer)


TOY = ToyConfig()


class ToyShape:
  """The toy's dimensions under the names `expected_shapes` reads: one layer, one head, head_dim wide."""
  vocab_size, num_layers, num_kv_heads, head_dim = TOY.vocab_size, TOY.num_layers, TOY.num_kv_heads, TOY.head_dim
  embed_dim = TOY.head_dim  # its hidden states are as wide as its one head


@pytest.mark.parametrize("request_", [r for r in requests(with_row_select=False, with_hidden_after=False)
                                      if not r[2]["skip_head"]], ids=label)
def test_the_toy_model_keeps_the_same_contract(request_):
  """The toy stands in for Gemma in the interpreter tests: the flags it takes, it answers as Gemma does."""
  pool, defer, flags = request_
  args, kw = call_args(ToyShape, pool, defer, flags)
  out = jax.eval_shape(lambda params: toy_apply(params, *args, **kw), toy_params(TOY, {}))
  check(out, expected_shapes(ToyShape, pool, defer, flags), defer)


def test_outputs_that_cannot_be_asked_together_are_refused():
  cfg = MODEL.config
  args, _ = call_args(cfg, False, False, dict.fromkeys(("return_hidden", "skip_head", "row_select", "logit_rows",
                                                        "hidden_after"), False))
  for kw in ({"hidden_after": LAYER, "return_hidden": True}, {"hidden_after": LAYER, "skip_head": True},
             {"hidden_after": cfg.num_layers}):
    with pytest.raises(ValueError, match="hidden_after"):
      jax.eval_shape(lambda params, kw=kw: Gemma(cfg).apply(params, *args, **kw), MODEL.params)
