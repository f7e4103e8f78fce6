"""Invariant 2: training forward == decode replay; invariant 3: untagged answers decode as plain.

The training forward runs the laid-out example once with the PASTA mask from the one visibility
rule; the interpreter force-replays the same answer token by token over its interleaved pool. Each
fed token's logits must agree: same mask, same positions, same model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.decode import api
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.rules import SequentialRules
from pasta_jax.lang.layout import layout_example
from pasta_jax.lang.metrics import annotated_from_records
from pasta_jax.lang.tags import TagVocab
from pasta_jax.lang.tokens import parse_tokens
from pasta_jax.model.config import get_config
from pasta_jax.model.gemma import Gemma, causal_mask, to_decode_layout
from tests.marks import HEAVY

VOCAB = TagVocab.from_base(400, eos_ids=(1,))
P, L10, L20, L40 = VOCAB.promise, VOCAB.length_token(10), VOCAB.length_token(20), VOCAB.length_token(40)
AE, SYNC, EOS = VOCAB.async_close, VOCAB.sync, 1
PROMPT = [2, 30, 31, 32, 33]
# Back-to-back promises, blocks shorter and longer than predicted, a sync while forks run, a later
# fork that sees the synced ones, and text after the last sync.
ANSWER = ([40, 41, P, 42, L10, *range(50, 54), AE, P, 43, 44, L20, *range(60, 85), AE, 45, SYNC, 46, 47,
           P, 48, L40, *range(90, 97), AE, 49, SYNC, 55, 56, EOS])


def random_params(name: str, seed: int = 0):
  cfg = get_config(name)
  model = Gemma(cfg)
  params = model.init(jax.random.key(seed), jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None], causal_mask(1, 4))
  # Random norm scales and larger weights make every layer matter for the logits.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return cfg, model, jax.tree.unflatten(tree, leaves)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(apply, params, ids):  # [1, W] -> logits [1, W, V]; one compile per (model, width)
  width = ids.shape[1]
  return apply(params, ids, jnp.arange(width)[None], causal_mask(1, width)).logits


def greedy_without_cache(apply, params, prompt: list[int], n: int, eos_ids, width: int = 64) -> list[int]:
  """The oracle of plain decoding: each token from a full causal forward over everything so far, no KV cache
  and no interpreter; the sequence is padded to `width` so one shape compiles."""
  tokens = list(prompt)
  for _ in range(n):
    logits = _full_forward(apply, params, jnp.asarray(tokens + [0] * (width - len(tokens)))[None])
    tokens.append(int(jnp.argmax(logits[0, len(tokens) - 1])))
    if tokens[-1] in eos_ids:
      break
  return tokens[len(prompt):]


def run_plain(apply, params, cfg, prompts, n: int, vocab, pool_spec):
  """Plain decoding through the one step driver: the sequential rules on one lane."""
  icfg = InterpreterConfig(vocab=vocab, lanes=1, max_threads=1, pool_slots=64, max_steps=n - 1, rules=SequentialRules())
  return run_interpreter(apply, params, prompts, icfg, vocab_size=cfg.vocab_size, pool_spec=pool_spec)


def scripts_of(answer: list[int]) -> list[list[int]]:
  """Per-thread scripts: main's tokens (blocks removed) and each block's content + </async>."""
  main, forks, fork = [], [], None
  for token in answer:
    if token == VOCAB.async_open:
      continue
    if fork is not None:
      fork.append(token)
      if token == AE:
        forks.append(fork)
        fork = None
      continue
    main.append(token)
    if VOCAB.is_length(token):
      fork = []
  return [main] + forks


def with_blocks(answer: list[int]) -> list[int]:
  """The layout form: `<async>` written before each block's content."""
  out = []
  for token in answer:
    out.append(token)
    if VOCAB.is_length(token):
      out.append(VOCAB.async_open)
  return out


def replay_logits(model, params, cfg, scripts, mode="pred"):
  icfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=128, max_steps=128,
                           record_logits=True, position_mode=mode)
  pool_spec = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
  # The interpreter runs the decode layout (as in production); the training forward, the training layout.
  out = run_interpreter(api.model_fn(cfg, jnp.float32), to_decode_layout(params), [PROMPT], icfg,
                        vocab_size=cfg.vocab_size, pool_spec=pool_spec, scripts=[scripts])[0]
  assert out.finished
  # Each record's logits came from feeding the previous token of the same thread at its position.
  by_input = {}
  last_pos = {0: len(PROMPT) - 1}
  for (_, _, thread, token, position), logits in zip(out.records.tolist(), out.logits):
    if token != VOCAB.async_open or thread == 0:
      by_input[(thread, last_pos[thread])] = logits
    last_pos[thread] = position
  return by_input


@pytest.mark.parametrize("name", ["tiny-gemma1", "tiny-gemma3"])
@pytest.mark.parametrize("mode", ["pred", "fixed"])
def test_training_forward_equals_decode_replay(name, mode):
  cfg, model, params = random_params(name)
  assert parse_tokens(with_blocks(ANSWER), VOCAB)  # well-formed
  layout = layout_example(PROMPT, with_blocks(ANSWER), VOCAB, mode=mode)
  train_logits = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                             layout.mask()[None]).logits
  replay = replay_logits(model, params, cfg, scripts_of(ANSWER), mode)
  matched = 0
  for j in range(len(PROMPT) - 1, int(np.asarray(layout.valid).sum())):
    key = (int(layout.thread[j]), int(layout.positions[j]))
    if key in replay:
      np.testing.assert_allclose(train_logits[0, j], replay[key], atol=1e-4, rtol=1e-5,
                                 err_msg=f"index {j} {key}")
      matched += 1
  # Every answer token is fed except each `</async>` and main's final EOS.
  fed = 1 + len(with_blocks(ANSWER)) - with_blocks(ANSWER).count(AE) - 1
  assert matched == fed
  assert not np.allclose(train_logits[0, -1], train_logits[0, -2])  # the model is not degenerate


def test_replay_sees_the_mask():
  """Guard: a causal (tag-blind) training mask gives different logits after a promise."""
  cfg, model, params = random_params("tiny-gemma3")
  layout = layout_example(PROMPT, with_blocks(ANSWER), VOCAB)
  n = len(layout.tokens)
  causal = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                       causal_mask(1, n)).logits
  pasta = model.apply(params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                      layout.mask()[None]).logits
  assert np.abs(np.asarray(causal - pasta)).max() > 1e-2


@pytest.mark.parametrize("name", ["tiny-gemma1", "tiny-gemma2", "tiny-gemma3"])
def test_untagged_answer_decodes_as_plain(name):
  cfg, model, params = random_params(name, seed=3)
  # Tag rows of the tied embedding at zero: their logits are 0, below the max of ~400 random ones,
  # so greedy decoding never emits a tag and the answer is untagged.
  emb = params["params"]["embedder"]
  params["params"]["embedder"] = emb.at[400:].set(0.0)
  prompts = [[2, 7, 8, 9], [2, 11, 12, 13, 14, 15, 16]]
  n = 40
  want = [greedy_without_cache(model.apply, params, p, n, (EOS,)) for p in prompts]
  icfg = InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=8, pool_slots=64, max_steps=n - 1)
  pool_spec = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
  got = run_interpreter(model.apply, params, prompts, icfg, vocab_size=cfg.vocab_size, pool_spec=pool_spec)
  plain = run_plain(model.apply, params, cfg, prompts, n, VOCAB, pool_spec)
  for w, g, p in zip(want, got, plain):
    main = [t for (_, _, thread, t, _) in g.records.tolist() if thread == 0]
    assert not set(main) & VOCAB.tag_ids
    assert main == w
    assert p.records[:, 3].tolist() == w  # the sequential rules: the same tokens
  assert want[0] != want[1]  # the continuations depend on the prompt: the comparison is not vacuous


@pytest.fixture(scope="module")
def real_model():
  from pasta_jax.model.load import load_model

  return load_model("base")


@pytest.mark.slow
@HEAVY  # the tiny Gemma 1/2/3 replays hold the rule; test_hf_parity.py checks the real 270M's forward
def test_real_270m_training_forward_equals_decode_replay(real_model):
  """One annotated example on the real Gemma 3 270M with its own tokenizer and reserved tag tokens."""

  model = real_model
  vocab = model.tokenizer.tag_vocab()
  lang_tok = api.LangTokenizer(model.tokenizer)
  answer = ('Two facts:<promise topic="sun" tokens="10"/><async> The sun is a star.</async>'
            '<promise topic="moon" tokens="10"/><async> The moon orbits Earth.</async> Both are bright.<sync/>'
            ' Done.')
  scripts = api.forced_scripts(answer, lang_tok, vocab)
  prompt = model.tokenizer.encode("Tell me two facts about the sky.", add_bos=True)
  cfg = model.config
  fn = api.model_fn(cfg, jnp.float32)
  icfg = InterpreterConfig(vocab=vocab, lanes=4, max_threads=8, pool_slots=128, max_steps=128, record_logits=True)
  out = run_interpreter(fn, api.decode_params(model.params, jnp.float32), [prompt], icfg, vocab_size=cfg.vocab_size,
                        pool_spec=api.pool_spec(cfg, jnp.float32), scripts=[scripts])[0]
  assert out.finished
  by_input, last_pos = {}, {0: len(prompt) - 1}
  for (_, _, thread, token, position), logits in zip(out.records.tolist(), out.logits):
    if token != vocab.async_open or thread == 0:
      by_input[(thread, last_pos[thread])] = logits
    last_pos[thread] = position
  layout = layout_example(prompt, annotated_from_records(out.records, vocab), vocab)
  train = Gemma(cfg).apply(model.params, jnp.asarray(layout.tokens)[None], jnp.asarray(layout.positions)[None],
                           layout.mask()[None]).logits
  matched = 0
  for j in range(len(prompt) - 1, len(layout.tokens)):
    key = (int(layout.thread[j]), int(layout.positions[j]))
    if key in by_input:
      # Logits here reach |40|; float32 sums in another order (one [L] forward vs [1]-row steps)
      # differ by up to ~2e-4 absolute, 6e-6 relative, depending on the CPU's kernels (1.3e-4 on small
      # logits on this project's 2026-11 machines). The tiny configs hold 1e-4 absolute; a wrong mask moves
      # logits by more than 0.1.
      np.testing.assert_allclose(train[0, j], by_input[key], atol=3e-4, rtol=1e-5, err_msg=f"index {j}")
      matched += 1
  assert matched == len(by_input) > 20


@pytest.mark.slow
@HEAVY  # the tiny-model variants above hold the rule
def test_real_270m_untagged_answer_decodes_as_plain(real_model):
  model, cfg = real_model, real_model.config

  fn = api.model_fn(cfg, jnp.float32)
  prompts = [model.tokenizer.encode(p, add_bos=True) for p in ("The capital of France is", "Water boils at")]
  params = api.decode_params(model.params, jnp.float32)
  # The sequential rules against the same oracle run on the tiny models (test_untagged_answer_decodes_as_plain).
  want = [greedy_without_cache(Gemma(cfg).apply, model.params, p, 16, model.tokenizer.eos_ids, width=32)
          for p in prompts]
  # 2 lanes: an untagged answer only ever feeds main; fewer lane buckets of the real model to compile
  icfg = InterpreterConfig(vocab=model.tokenizer.tag_vocab(), lanes=2, max_threads=8, pool_slots=64, max_steps=15)
  pool_spec = api.pool_spec(cfg, jnp.float32)
  got = run_interpreter(fn, params, prompts, icfg, vocab_size=cfg.vocab_size, pool_spec=pool_spec)
  for w, g in zip(want, got):
    assert [t for (_, _, thread, t, _) in g.records.tolist() if thread == 0] == w
