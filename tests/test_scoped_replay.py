"""Scoped mode, invariant 2: the training forward over the scoped layout equals the interpreter's forced replay.

The training forward runs the laid-out example once with the mask and positions of `scoped_layout`; the
interpreter force-replays the same answer over its interleaved pool (nested scopes, a promise inside a fork,
several scopes in sequence). Every fed token's logits must agree.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode import api
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.reference.scoped import run_scoped_reference
from pasta_jax.decode.rules.scoped import ScopedRules
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.lang import scoped
from pasta_jax.lang.scoped_layout import scoped_layout
from pasta_jax.model.gemma import causal_mask, to_decode_layout
from tests.marks import HEAVY
from tests.test_replay import VOCAB, random_params
from tests.test_scoped_layout import layout_parents, thread_map

P, AO, AC, SO, SC, EOS = (VOCAB.bare_promise, VOCAB.async_open, VOCAB.async_close, VOCAB.scope_open,
                          VOCAB.scope_close, 1)
PROMPT = [2, 30, 31, 32, 33]
# A list scope with three items, the second item's block holding a nested scope with its own fork, then a
# second scope in sequence, and text after it.
ANSWER = [40, SO, 41, P, AO, 50, 51, AC, 42, P, AO, 52, SO, 53, P, AO, 60, 61, 62, AC, SC, 54, AC, 43, P, AO,
          55, AC, SC, 44, SO, P, AO, 70, AC, 45, SC, 46, EOS]


def forced_replay(cfg, params, prompt, answer, vocab, *, lanes=4, max_threads=8, pool_slots=128, dtype=jnp.float32):
  """The jitted interpreter's forced replay of `answer` (text order), with logits; thread ids from a schedule
  run of the reference (no model)."""
  tree = scoped.answer_script(answer, vocab)
  icfg = InterpreterConfig(vocab=vocab, lanes=lanes, max_threads=max_threads, pool_slots=pool_slots,
                           max_steps=512, record_logits=True, rules=ScopedRules())
  schedule = run_scoped_reference(None, None, [prompt], vocab, lanes=lanes, max_threads=max_threads,
                                  pool_slots=pool_slots, max_steps=512, sampling=SamplingConfig(), scripts=[tree])[0]
  out = run_interpreter(api.model_fn(cfg, dtype), to_decode_layout(params), [prompt], icfg,
                        vocab_size=cfg.vocab_size, pool_spec=api.pool_spec(cfg, dtype),
                        scripts=[schedule.scripts_by_thread])[0]
  assert out.finished
  return out


def replay_by_input(out, prompt_len: int) -> dict:
  """(thread, position of the fed token) -> the logits its query produced."""
  by_input, last_pos = {}, {0: prompt_len - 1}
  for (_, _, thread, _, position), logits in zip(out.records.tolist(), out.logits):
    if thread in last_pos:
      by_input[(thread, last_pos[thread])] = logits
    last_pos[thread] = position
  return by_input


def compare(layout, train_logits, out, prompt_len: int, atol: float) -> int:
  n = int(layout.valid.sum())
  mapping = thread_map([int(p) for p in out.parents[: 1 + int(out.records[:, 2].max())]],
                       layout_parents(layout.thread, n))
  replay = {(mapping[u], pos): logits for (u, pos), logits in replay_by_input(out, prompt_len).items()}
  matched = 0
  for j in range(prompt_len - 1, n):
    key = (int(layout.thread[j]), int(layout.positions[j]))
    if key in replay:
      np.testing.assert_allclose(train_logits[j], replay[key], atol=atol, rtol=1e-5, err_msg=f"index {j} {key}")
      matched += 1
  return matched


@pytest.mark.parametrize("name", ["tiny-gemma1", "tiny-gemma3"])
def test_scoped_training_forward_equals_decode_replay(name):
  cfg, model, params = random_params(name)
  layout = scoped_layout(PROMPT, ANSWER, VOCAB)
  train_logits = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                             layout.mask()[None]).logits
  out = forced_replay(cfg, params, PROMPT, ANSWER, VOCAB)
  matched = compare(layout, np.asarray(train_logits[0]), out, len(PROMPT), atol=1e-4)
  # Every answer token is fed (its query's logits recorded) except each `</async>` and main's end id.
  assert matched == 1 + len(ANSWER) - ANSWER.count(AC) - 1
  causal = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                       causal_mask(1, len(layout.tokens))).logits
  assert np.abs(np.asarray(causal - train_logits)).max() > 1e-2  # the mask matters: the check is not vacuous


@pytest.mark.slow
@HEAVY  # the tiny Gemma 1/2/3 variants above hold the rule
def test_real_270m_scoped_training_forward_equals_decode_replay():
  """One scoped annotation (a list scope, a nested scope inside a block) on the real Gemma 3 270M."""
  from pasta_jax.model.gemma import Gemma
  from pasta_jax.model.load import load_model

  model = load_model("base")
  vocab = model.tokenizer.tag_vocab()
  lang = api.LangTokenizer(model.tokenizer)
  text = ("Two fuels:\n<scope>1. Coal:<promise/><async> a fossil fuel.</async>\n2. Wood:<promise/><async> it regrows."
          "\n<scope>- Oak:<promise/><async> dense.</async></scope></async>\n</scope>Both burn.")
  answer = scoped.encode(scoped.parse(text), lang.encode, vocab) + [vocab.eos_ids[0]]
  prompt = model.tokenizer.encode("Name two fuels.", add_bos=True)
  layout = scoped_layout(prompt, answer, vocab)
  train_logits = Gemma(model.config).apply(model.params, jnp.asarray(layout.tokens)[None],
                                           jnp.asarray(layout.positions)[None], layout.mask()[None]).logits
  out = forced_replay(model.config, model.params, prompt, answer, vocab)
  matched = compare(layout, np.asarray(train_logits[0]), out, len(prompt), atol=1e-4)
  assert matched == 1 + len(answer) - answer.count(vocab.async_close) - 1
