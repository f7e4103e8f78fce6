"""Hypothesis strategies for scoped (earlier-paper) tag programs: script trees with nested scopes, promises in
forks, scopes in sequence, EOS inside a scope, and more promises than lanes."""

from __future__ import annotations

from hypothesis import strategies as st

from pasta_jax.lang.scoped import ThreadScript
from tests.programs import PLAIN_TOKENS, VOCAB

EOS = VOCAB.eos_ids[0]
MAX_DEPTH = 3


@st.composite
def thread_tokens(draw, *, is_fork: bool, scope_depth: int, fork_depth: int, budget: list[int], well_formed: bool):
  """(tokens, children) of one thread's body: text, scopes and promises in any order, well nested."""
  tokens: list[int] = []
  children: list[ThreadScript] = []

  def body(depth: int, in_scope: bool):
    for _ in range(draw(st.integers(0, 4))):
      if budget[0] <= 0:
        return
      kinds = ["text", "text"]
      if depth < MAX_DEPTH:
        kinds.append("scope")
      if (in_scope or is_fork) and fork_depth < MAX_DEPTH:
        kinds += ["promise", "promise"]
      kind = draw(st.sampled_from(kinds))
      if kind == "text":
        run = draw(st.lists(PLAIN_TOKENS, min_size=1, max_size=4))
        budget[0] -= len(run)
        tokens.extend(run)
      elif kind == "scope":
        tokens.append(VOCAB.scope_open)
        body(depth + 1, True)
        tokens.append(VOCAB.scope_close)
      else:
        tokens.append(VOCAB.bare_promise)
        budget[0] -= 1
        children.append(draw(fork_script(scope_depth=depth, fork_depth=fork_depth + 1, budget=budget,
                                         well_formed=well_formed)))

  body(scope_depth, False)
  return tokens, children


@st.composite
def fork_script(draw, *, scope_depth: int, fork_depth: int, budget: list[int], well_formed: bool) -> ThreadScript:
  tokens, children = draw(thread_tokens(is_fork=True, scope_depth=scope_depth, fork_depth=fork_depth, budget=budget,
                                        well_formed=well_formed))
  ends = [VOCAB.async_close] if well_formed else [VOCAB.async_close, VOCAB.async_close, EOS]
  end = draw(st.sampled_from(ends))  # EOS in a fork closes it
  return ThreadScript(tuple(tokens) + (end,), tuple(children))


@st.composite
def scoped_programs(draw, budget: int = 60, well_formed: bool = False) -> ThreadScript:
  """Main's script tree. Unless `well_formed`, main sometimes ends inside an open scope (its end id is then
  the final sync) and forks sometimes end with an end id (which closes them)."""
  left = [budget]
  tokens: list[int] = []
  children: list[ThreadScript] = []
  for _ in range(draw(st.integers(1, 3))):  # scopes in sequence, text between
    tokens += draw(st.lists(PLAIN_TOKENS, max_size=3))
    inner, kids = draw(thread_tokens(is_fork=False, scope_depth=1, fork_depth=0, budget=left, well_formed=well_formed))
    tokens += [VOCAB.scope_open, *inner, VOCAB.scope_close]
    children += kids
  tokens += draw(st.lists(PLAIN_TOKENS, max_size=3))
  # EOS inside a scope: cut before a `</scope>`
  if not well_formed and draw(st.booleans()) and VOCAB.scope_close in tokens:
    cut = draw(st.sampled_from([i for i, t in enumerate(tokens) if t == VOCAB.scope_close]))
    promises = tokens[:cut].count(VOCAB.bare_promise)
    tokens, children = tokens[:cut], children[:promises]
  return ThreadScript(tuple(tokens) + (EOS,), tuple(children))


def text_order(script: ThreadScript) -> list[int]:
  """The annotated answer in text order: each `<promise/>` followed by `<async>` and its block."""
  out, k = [], 0
  for token in script.tokens:
    out.append(token)
    if token == VOCAB.bare_promise:
      out += [VOCAB.async_open, *text_order(script.children[k])]
      k += 1
  return out
