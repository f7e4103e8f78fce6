"""PASTA x token trees (decode/rules/pasta_tree.py): every live thread speculates with a Medusa tree in one step.

Oracle: the PASTA interpreter's own greedy decoding. Greedy acceptance is lossless, so each thread writes exactly
the tokens it writes without trees (up to where a full pool cut either run), whatever the tree and the heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import run_interpreter
from pasta_jax.decode.result import content_ids
from pasta_jax.decode.rules.medusa import MedusaRules
from pasta_jax.decode.rules.pasta_tree import PastaTreeRules
from pasta_jax.decode.rules.sequential import SequentialRules
from pasta_jax.decode.state import STEP, THREAD, TOKEN
from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
from pasta_jax.decode.tree import TokenTree
from pasta_jax.errors import PastaError
from pasta_jax.lang.metrics import annotated_from_records
from pasta_jax.methods import Pasta, PastaTrees, generate_ids
from pasta_jax.model import medusa
from tests.programs import VOCAB, VOCAB_SIZE
from tests.test_medusa import MODEL, PROMPTS, drafter
from tests.test_tree import choices_lists

TOY = ToyConfig(vocab_size=VOCAB_SIZE)
# Biases that make the greedy toy model write real programs (promises, forks, syncs, ends).
TAG_BIAS = {VOCAB.promise: 2.5, VOCAB.sync: 2.5, VOCAB.async_close: 3.0, 1: 3.0,
            **{t: 2.0 for t in VOCAB.lengths[:4]}}
TOY_PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [20, 21, 22, 23, 24]]
THREADS = 16


def toy(seed: int) -> dict:
  """The greedy toy model, its attention's weight raised so that what a row sees decides what it writes (a node
  with a fork's view where it should have main's, or the reverse, changes the answer)."""
  params = toy_params(TOY, TAG_BIAS, seed=seed)
  return {**params, "readout": 3.0 * params["readout"]}


def toy_heads(params, num_heads: int, scale: float, seed: int, next_token: bool = False) -> dict:
  """Heads over the toy's readout rows; scale 0: each head starts as the base readout (guesses loops well).
  next_token: heads that also read the bonus token (random U of the same scale)."""
  config = medusa.MedusaConfig(num_heads=num_heads, next_token=next_token)
  heads = medusa.init_heads(config, params["readout"].T)
  noise = {k: scale * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), heads[k].shape)
           for i, k in enumerate(("w", "u")) if k in heads}
  return {**heads, **{k: heads[k] + v for k, v in noise.items()}}


def run(params, prompts, lanes: int, pool: int, tree: TokenTree | None = None, heads=None, num_heads: int = 3,
        budget: int = 0, head_dim: int = TOY.head_dim):
  """The toy model's greedy runs: plain PASTA on `lanes` lanes, or with a tree on each of them (heads: Medusa
  heads over the toy's readout rows, or a dict that brings its own "drafted" rows)."""
  pool_spec = (1, 1, head_dim, jnp.float32)
  if tree is None:
    cfg = InterpreterConfig(vocab=VOCAB, lanes=lanes, max_threads=THREADS, pool_slots=pool, max_steps=256,
                            max_content=budget)
    return run_interpreter(toy_apply, params, prompts, cfg, vocab_size=VOCAB_SIZE, pool_spec=pool_spec)
  rules = PastaTreeRules(tree=tree, thread_lanes=lanes, threads=THREADS, num_heads=num_heads, top_k=4)
  cfg = InterpreterConfig(vocab=VOCAB, lanes=lanes * tree.size, max_threads=THREADS + rules.node_lanes,
                          pool_slots=pool, max_steps=256, rules=rules, max_content=budget)
  inputs = medusa.bind_rows({"heads": heads, "drafted": heads.get("drafted", params["readout"].T)},
                            params["readout"].T)
  return run_interpreter(toy_apply, params, prompts, cfg, vocab_size=VOCAB_SIZE, pool_spec=pool_spec,
                         rule_inputs=inputs)


def per_thread(out) -> dict[int, list[int]]:
  threads: dict[int, list[int]] = {}
  for row in out.records:
    threads.setdefault(int(row[THREAD]), []).append(int(row[TOKEN]))
  return threads


def assert_content_counted(outs):
  """The device's content count (what the budget reads) is the recount of the records: a tree path that ends at
  main's PROMISE is content before the tag, not topic."""
  for out in outs:
    assert out.content == len(content_ids(annotated_from_records(out.records, VOCAB), VOCAB))


def assert_same_threads(plain, trees):
  """Each thread's tokens equal, up to where a full pool cut either run; whole answers equal when both end."""
  for p, t in zip(plain, trees, strict=True):
    a, b = per_thread(p), per_thread(t)
    if p.finished and t.finished:
      assert a == b
      continue
    for u in set(a) & set(b):
      n = min(len(a[u]), len(b[u]))
      assert a[u][:n] == b[u][:n], f"thread {u}"
    assert p.finished or p.pool_full or p.truncated
    assert t.finished or t.pool_full or t.truncated


@settings(max_examples=3, deadline=None)
@given(choices_lists(max_depth=3, max_rank=3, max_nodes=6), st.sampled_from([0, 1]), st.sampled_from([2, 4]),
       st.sampled_from([96, 256]), st.sampled_from([0.0, 0.5]))
def test_greedy_trees_on_every_thread_write_pastas_greedy_answer(choices, seed, lanes, pool, scale):
  params = toy(seed)
  tree = TokenTree.from_choices(choices)
  trees = run(params, TOY_PROMPTS, lanes, pool, tree, toy_heads(params, 3, scale, seed))
  assert_same_threads(run(params, TOY_PROMPTS, lanes, pool), trees)
  assert_content_counted(trees)


def test_next_token_heads_on_every_thread_write_pastas_greedy_answer():
  """Heads that read each thread's bonus token: still PASTA's greedy answer, and trees still accept."""
  params = toy(1)
  tree = TokenTree.from_choices([(0,), (0, 0), (1,)])
  trees = run(params, TOY_PROMPTS, 4, 256, tree, toy_heads(params, 3, 0.05, 1, next_token=True))
  assert_same_threads(run(params, TOY_PROMPTS, 4, 256), trees)
  assert sum(out.rule_outputs["tree_tokens"] for out in trees) > sum(out.rule_outputs["tree_steps"] for out in trees)


def test_next_token_heads_read_the_new_root(monkeypatch):
  """A tree's heads read the next root (the base model's choice at the accepted path's end), not the root just
  verified. Heads stubbed to propose succ[x] for next token x (succ: each token's successor in the toy's plain
  greedy answers) on a 2-node tree (root + head 0's top token): a step writes two tokens exactly where the answer's
  token after the root is succ[root], which a walk along the answer counts. (Plain greedy of the tiny Gemma
  repeats one token, where the two roots agree; the toy's answers vary.)"""
  params, pool_spec = toy(0), (1, 1, TOY.head_dim, jnp.float32)
  plain_cfg = InterpreterConfig(vocab=VOCAB, lanes=1, max_threads=1, pool_slots=256, max_steps=220,
                                rules=SequentialRules())
  plain = run_interpreter(toy_apply, params, TOY_PROMPTS, plain_cfg, vocab_size=VOCAB_SIZE, pool_spec=pool_spec)
  succ = np.zeros(VOCAB_SIZE, np.int32)
  for out in plain:
    toks = out.records[:, TOKEN]
    succ[toks[:-1]] = toks[1:]
  table = jnp.asarray(succ)

  def stub(inputs, hidden, next_tokens, top_k, softcap=None):
    return jnp.broadcast_to(table[next_tokens][..., None, None], next_tokens.shape + (3, top_k))

  monkeypatch.setattr(medusa, "rule_top_tokens", stub)
  jax.clear_caches()
  rules = MedusaRules(tree=TokenTree.from_choices([(0,)]), num_heads=3, top_k=4)
  cfg = InterpreterConfig(vocab=VOCAB, lanes=2, max_threads=2, pool_slots=256, max_steps=100, rules=rules)
  heads = toy_heads(params, 3, 0.1, 0, next_token=True)
  inputs = medusa.bind_rows({"heads": heads, "drafted": params["readout"].T}, params["readout"].T)
  trees = run_interpreter(toy_apply, params, TOY_PROMPTS, cfg, vocab_size=VOCAB_SIZE, pool_spec=pool_spec,
                          rule_inputs=inputs)
  jax.clear_caches()
  doubled = 0
  for p, t in zip(plain, trees, strict=True):
    toks = t.records[:, TOKEN].tolist()
    assert toks == p.records[:len(toks), TOKEN].tolist()
    i, doubles = 1, 0  # the first tree step feeds the root alone (no candidates yet)
    while i < len(toks) - 1:
      double = toks[i + 1] == succ[toks[i]]
      doubles, i = doubles + double, i + 1 + double
    assert t.rule_outputs["tree_tokens"] - t.rule_outputs["tree_steps"] == doubles
    doubled += doubles
  assert doubled > 20


def test_forks_speculate_alongside_main():
  """Not vacuous: in one step several threads each write a multi-token path, forks included; answers still equal."""
  params = toy(0)
  tree = TokenTree.from_choices([(0,), (1,), (0, 0), (0, 0, 0)])
  trees = run(params, TOY_PROMPTS, 4, 256, tree, toy_heads(params, 3, 0.0, 0))
  assert_same_threads(run(params, TOY_PROMPTS, 4, 256), trees)
  assert_content_counted(trees)
  assert max(out.rule_outputs["accept_length"] for out in trees) > 2.0
  grown_forks, together = set(), 0
  for out in trees:
    written = out.records[out.records[:, TOKEN] != VOCAB.async_open]  # a spawn's `<async>` is recorded beside it
    pairs, counts = np.unique(written[:, [STEP, THREAD]], axis=0, return_counts=True)
    grown = pairs[counts > 1]  # (step, thread): the thread wrote a path of several tokens in that step
    grown_forks |= set(grown[grown[:, 1] > 0, 1].tolist())
    together += int(np.sum(np.unique(grown[:, 0], return_counts=True)[1] > 1))
  assert grown_forks and together > 0


def test_a_full_pool_cuts_tree_runs_cleanly():
  """Rejected nodes free their slots; a pool too small for the answer still cuts it as the plain run's prefix."""
  params = toy(0)
  tree = TokenTree.from_choices([(0,), (1,), (2,), (0, 0)])
  trees = run(params, TOY_PROMPTS, 2, 48, tree, toy_heads(params, 3, 0.5, 1))
  assert any(t.pool_full for t in trees)
  assert_same_threads(run(params, TOY_PROMPTS, 2, 48), trees)


def test_trees_add_no_overshoot_past_the_content_budget_and_grow_until_near_it():
  params = toy(0)
  tree = TokenTree.from_choices([(0,), (0, 0), (0, 0, 0)])
  trees = run(params, TOY_PROMPTS, 4, 256, tree, toy_heads(params, 3, 0.0, 0), budget=30)
  assert_same_threads(run(params, TOY_PROMPTS, 4, 256, budget=30), trees)
  assert_content_counted(trees)
  cut = [t for t in trees if t.budget_spent]
  # PASTA's own overshoot (a step's other lanes record beside the one that reaches the budget), never a tree's
  assert cut and all(t.content <= 30 + 4 - 1 for t in trees)
  assert all(t.rule_outputs["tree_tokens"] > 15 for t in cut)  # trees ran until the last few tokens


def chain_model(chain: dict[int, int], heads: int):
  """A toy whose next token is chain[token] for sure, and Medusa heads that know the chain: head k proposes the
  token k + 2 ahead. Hidden states are (scaled) one-hot rows of the current token."""
  vocab = TOY.vocab_size
  table = np.full((vocab, vocab), -10.0, np.float32)
  for a, b in chain.items():
    table[a, b] = 10.0
  params = {"table": jnp.asarray(table), "embed": jnp.asarray(10.0 * np.eye(vocab, dtype=np.float32)),
            "readout": jnp.zeros((vocab, vocab)), "bias": jnp.zeros((vocab,))}
  w = np.zeros((heads, vocab, vocab), np.float32)
  for a in chain:
    ahead = a
    for k in range(heads + 1):
      ahead = chain.get(ahead, ahead)
      if k >= 1:
        w[k - 1, a, ahead] = 50.0
  return params, {"w": jnp.asarray(w), "b": jnp.zeros((heads, vocab)), "drafted": jnp.eye(vocab)}


def test_a_path_that_ends_at_a_promise_counts_its_text_as_content():
  """Main's path 12 13 14 ends at its PROMISE in one step: the text before the tag is content (the budget counts
  it), the fork and main's text after it come out as PASTA writes them, in fewer steps."""
  v = VOCAB
  main = [10, 11, 12, 13, 14, v.promise, 30, v.length_token(10), 15, 16, 17, 18, v.sync, 19, 20, 21, 1]
  fork = [v.async_open, 31, 32, 33, 34, v.async_close]
  chain = dict(zip(main, main[1:])) | dict(zip(fork, fork[1:]))
  params, heads = chain_model(chain, heads=3)
  tree = TokenTree.from_choices([(0,), (0, 0), (0, 0, 0)])
  plain = run(params, [[10]], 2, 64, head_dim=TOY.vocab_size)
  trees = run(params, [[10]], 2, 64, tree, heads, head_dim=TOY.vocab_size)
  assert per_thread(plain[0]) == per_thread(trees[0]) == {0: main[1:], 1: fork}
  assert trees[0].content == plain[0].content == 15
  assert trees[0].steps < plain[0].steps
  assert_content_counted(trees)


def test_lanes_must_fit_the_trees():
  rules = PastaTreeRules(tree=TokenTree.from_choices([(0,), (1,)]), thread_lanes=2, threads=THREADS, num_heads=2,
                         top_k=2)
  with pytest.raises(ValueError, match="need lanes = 6 and max_threads = 20"):
    InterpreterConfig(vocab=VOCAB, lanes=4, max_threads=THREADS, rules=rules)


# --- the API on a real (tiny) Gemma: its hidden states feed the heads --------------------------------------
def test_generate_pasta_medusa_equals_pasta_on_a_tiny_gemma():
  d = drafter(seed=0, scale=0.05)
  results = generate_ids(MODEL, PROMPTS, PastaTrees(heads=d, tree_size=4, lanes=2), max_new_tokens=41)
  plain_runs = generate_ids(MODEL, PROMPTS, Pasta(lanes=2), max_new_tokens=41)
  for plain, tree in zip(plain_runs, results, strict=True):
    assert tree.text == plain.text and tree.annotated == plain.annotated
    assert tree.method == "pasta+medusa"
  # one thread each: never past the budget (max_new_tokens), as plain PASTA
  assert [r.content_tokens for r in results] == [p.content_tokens for p in plain_runs] == [0, 41, 41]
  # (prompt 0 loops on a tag id, which no tree speculates on; the others are answer text)
  assert [r.speculation["tree_tokens"] > 0 for r in results] == [False, True, True]
  assert max(r.speculation["accept_length"] for r in results) > 1.5


def test_tree_options_are_refused_where_they_do_not_apply():
  with pytest.raises(PastaError, match="forced"):
    generate_ids(MODEL, PROMPTS, PastaTrees(heads=drafter()), scripts=[[[5]]] * 3)


def test_eval_method_uses_the_models_heads():
  from pasta_jax.commands.eval_registry import eval_methods
  from pasta_jax.eval.methods import DecodeSettings, MethodSpec
  with pytest.raises(PastaError, match="no Medusa heads for random:tiny-gemma3"):
    eval_methods()["pasta+medusa"](MethodSpec("pasta+medusa"), MODEL, DecodeSettings())
