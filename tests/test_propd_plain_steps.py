"""ProPD where no tree pays runs plain decoding's step (decode/rules/medusa.py: `MedusaRules.cheaper_steps`).

Oracle: plain decoding's own traced loop. The step ProPD takes while no request plans a tree must do the model work
of plain decoding's step, no more (one row per request, the same attention length, the same K/V reads and writes),
with the heads only inside a conditional (probe steps, or a tree planned next). Structural, from the traced programs:
it holds on any machine, costs no timing, and fails on a planted regression (the cheaper step dropped, or the heads
run on every plain step). That ProPD takes this step, and leaves it for trees when they pay, is in
tests/test_medusa.py (the runs' `plain_steps`).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

from pasta_jax.decode import api, loop
from pasta_jax.methods import Propd, Sequential, prepare_run
from tests.test_medusa import MODEL, PROMPTS, drafter

NEVER_PAYS = {1: 1.0, 2: 5.0, 4: 9.0, 8: 17.0}  # seconds per step: no tree can beat a plain step
NEW_TOKENS = 24  # the plain and ProPD pools then have the same size (one bucket), so the programs compare


def traced_loop(method):
  prep = prepare_run(MODEL, PROMPTS, method, max_new_tokens=NEW_TOKENS)
  static = dict(cfg=loop.static_config(prep.cfg), forced=prep.forced, vocab_size=prep.vocab_size,
                pool_spec=prep.pool_spec)
  return jax.make_jaxpr(functools.partial(loop.prefill_and_run, prep.model_fn, **static))(*api.dynamic_args(prep)), prep


def inner_jaxprs(value):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from inner_jaxprs(v)


def loops(jaxpr) -> list:
  """The bodies of the while loops in `jaxpr` that run the model (hold a dot), outermost first."""
  found = []
  for eqn in jaxpr.eqns:
    for name, value in eqn.params.items():
      for inner in inner_jaxprs(value):
        if eqn.primitive.name == "while" and name == "body_jaxpr" and model_work(inner, into_conds=True)[0]:
          found.append(inner)
        found.extend(loops(inner))
  return found


def model_work(jaxpr, into_conds: bool, pool_shape=None):
  """(Counter of the dots' operand shapes, Counter of the ops that read or write a pool-shaped array) in `jaxpr`,
  loops included, conditionals' branches only with `into_conds`."""
  dots, pool_ops = collections.Counter(), collections.Counter()
  for eqn in jaxpr.eqns:
    shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in (*eqn.invars, *eqn.outvars))
    if eqn.primitive.name == "dot_general":
      dots[shapes[:2]] += 1
    if pool_shape is not None and pool_shape in shapes:
      pool_ops[eqn.primitive.name] += 1
    if eqn.primitive.name == "cond" and not into_conds:
      continue
    for value in eqn.params.values():
      for inner in inner_jaxprs(value):
        more_dots, more_pool = model_work(inner, into_conds, pool_shape)
        dots, pool_ops = dots + more_dots, pool_ops + more_pool
  return dots, pool_ops


def test_propd_plain_step_does_plain_decodings_model_work():
  """ProPD's loop holds, inside its tree loop, a loop of plain decoding's step: the same dots (one query row per
  request against the same pool) and the same pool reads and writes as plain decoding's loop body, outside its
  conditionals; inside them only the heads, which read no pool and share no dot with the model."""
  plain, plain_prep = traced_loop(Sequential())
  propd, propd_prep = traced_loop(Propd(heads=drafter(), tree_size=8, latency=NEVER_PAYS))
  assert plain_prep.cfg.pool_slots == propd_prep.cfg.pool_slots
  pool_shape = tuple(plain_prep.pool_spec[:1]) + (len(PROMPTS), plain_prep.cfg.pool_slots) + plain_prep.pool_spec[1:3]
  (plain_body,) = loops(plain.jaxpr)
  tree_body, plain_steps = loops(propd.jaxpr)  # ProPD's own step, then the loop of plain steps inside it
  want = model_work(plain_body, into_conds=False, pool_shape=pool_shape)
  assert want[0] and want[1]  # not vacuous: the model runs there, and writes the pool
  assert model_work(plain_steps, into_conds=False, pool_shape=pool_shape) == want
  every_dot, every_pool_op = model_work(plain_steps, into_conds=True, pool_shape=pool_shape)
  assert every_pool_op == want[1] and every_dot - want[0] == heads_work(propd_prep)
  assert model_work(tree_body, into_conds=True)[0] != want[0]  # the tree step is another program


def heads_work(prep) -> collections.Counter:
  """The dots of the heads' two passes a plain step may take: head 0's (a probe) and every head's (a tree next)."""
  rules, inputs = prep.cfg.rules, prep.rule_inputs
  d = rules.init_rule_state(prep.tokens, prep.lengths, inputs, prep.cfg)
  hidden, root = jnp.zeros((len(PROMPTS), MODEL.config.embed_dim)), jnp.zeros((len(PROMPTS),), jnp.int32)
  passes = (lambda: rules.probe_tokens(d, hidden, root), lambda: rules.top_tokens(inputs, hidden, root))
  return sum((model_work(jax.make_jaxpr(f)().jaxpr, into_conds=True)[0] for f in passes), collections.Counter())
