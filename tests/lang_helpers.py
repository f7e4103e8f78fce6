"""Shared helpers for the PASTA-LANG tests: a character-level tokenizer, a synthetic TagVocab, and
hypothesis strategies for random well-formed annotated programs (text and token level)."""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import strategies as st

from pasta_jax.lang import text as T
from pasta_jax.lang.tags import LENGTH_STEP, MAX_LENGTH, TagVocab, round_length

PAD, EOS, BOS = 0, 1, 2
VOCAB = TagVocab.from_base(3, eos_ids=(EOS,))  # tags on ids 3 .. 58
# Pred-1x: the same tags with one LENGTH token per exact length, on ids 1000 .. 1499 (above the text).
EXACT_VOCAB = TagVocab(**{**{f: getattr(VOCAB, f) for f in ("promise", "async_open", "async_close", "sync",
                                                              "apar_fork", "apar_child", "scope_open", "scope_close",
                                                              "bare_promise")},
                          "lengths": tuple(range(1000, 1500)), "eos_ids": (EOS,), "length_step": 1})


def vocab_for(mode: str) -> TagVocab:
  return EXACT_VOCAB if mode == "pred-1x" else VOCAB


def in_vocab(ids: list[int], vocab: TagVocab) -> list[int]:
  """An answer in VOCAB's tokens with each LENGTH token moved to `vocab`'s token for the same value."""
  return [vocab.length_token(VOCAB.length_of(t)) if VOCAB.is_length(t) else t for t in ids]
CHAR_BASE = 100  # ordinary characters: id = CHAR_BASE + ord(c)


class CharTokenizer:
  """One token per character (no BOS); decode is the exact inverse."""

  def encode(self, text: str) -> list[int]:
    return [CHAR_BASE + ord(c) for c in text]

  def decode(self, ids) -> str:
    return "".join(chr(i - CHAR_BASE) for i in ids)


CHARS = CharTokenizer()


def char_count(text: str) -> int:
  return len(CHARS.encode(text))


# --- text-level programs -------------------------------------------------------------------------------
# Fragments that look like tags but are not (the exact grammar must keep them as text).
LOOKALIKES = ["<p>", "</p>", "<promise", "<promise>", "<promise/>", "<sync />", "<async", "async>", "</async",
              "<Async>", "<promise topic='x' tokens='40'/>", '<promise tokens="40" topic="x"/>', 'topic="',
              'tokens="40"', "/>", "<", ">", '"', "'", "&quot;", "</sync>", "<sync>"]
plain_chars = st.text(alphabet=st.sampled_from(list("ab z.,\n\t-é中🙂")), min_size=1, max_size=6)
plain_text = st.lists(st.one_of(plain_chars, st.sampled_from(LOOKALIKES)), min_size=1, max_size=4).map(
    "".join).filter(lambda s: T.TAG_PATTERN.search(s) is None)
topics = st.text(alphabet=st.sampled_from(list("ab xy'é-\n")), max_size=8)
lengths = st.sampled_from(list(range(LENGTH_STEP, MAX_LENGTH + 1, LENGTH_STEP)))


def programs(max_items: int = 8):
  """Random well-formed programs whose (merged) texts spell no tag."""
  return _programs(max_items).filter(lambda segments: all(
      T.TAG_PATTERN.search(s.text) is None for s in segments if isinstance(s, T.Text)))


@st.composite
def _programs(draw, max_items: int = 8) -> list[T.Segment]:
  """A random well-formed program as normalized segments (text, promise + block pairs, syncs)."""
  segments: list[T.Segment] = []
  for _ in range(draw(st.integers(0, max_items))):
    kind = draw(st.sampled_from(["text", "text", "block", "sync"]))
    if kind == "text":
      segments.append(T.Text(draw(plain_text)))
    elif kind == "block":
      content = draw(st.one_of(st.just(""), plain_text))
      segments += [T.Promise(draw(topics), draw(lengths)), T.Block((T.Text(content),) if content else ())]
    else:
      segments.append(T.Sync())
  return T.normalize(segments)


def exact_lengths(segments: list[T.Segment]) -> list[T.Segment]:
  """The same program with each promise's tokens = round_length(true character count of its block)."""
  out = list(segments)
  for i, seg in enumerate(out):
    if isinstance(seg, T.Promise):
      out[i] = T.Promise(seg.topic, round_length(char_count(out[i + 1].text)))
  return out


# --- token-level programs ------------------------------------------------------------------------------
ORDINARY = (64, 127)  # ordinary token ids, inclusive (inside the toy model's 128-token vocab)


def token_program(draw_or_rng, max_items: int = 6, max_run: int = 4, max_block: int = 6) -> list[int]:
  """A random annotated answer as ids (no end id). Works with a numpy Generator or a hypothesis `draw`."""
  if isinstance(draw_or_rng, np.random.Generator):
    rng = draw_or_rng
    integer = lambda lo, hi: int(rng.integers(lo, hi + 1))
  else:
    integer = lambda lo, hi: draw_or_rng(st.integers(lo, hi))
  run = lambda lo, hi: [integer(*ORDINARY) for _ in range(integer(lo, hi))]
  ids: list[int] = []
  for _ in range(integer(0, max_items)):
    kind = integer(0, 3)
    if kind <= 1:
      ids += run(1, max_run)
    elif kind == 2:
      ids += [VOCAB.promise] + run(0, 2) + [VOCAB.length_token(LENGTH_STEP * integer(1, 5))]
      ids += [VOCAB.async_open] + run(0, max_block) + [VOCAB.async_close]
    else:
      ids.append(VOCAB.sync)
  return ids


@st.composite
def token_programs(draw, max_items: int = 6) -> list[int]:
  return token_program(draw, max_items=max_items)


prompts = st.lists(st.integers(*ORDINARY), min_size=1, max_size=3)


# --- forced replay through the jitted interpreter (toy model) ---------------------------------------------
def scripts_of(ids: list[int], vocab: TagVocab = VOCAB) -> list[list[int]]:
  """Per-thread scripts of an annotated answer: main (blocks removed) + EOS; each fork: content + </async>."""
  from pasta_jax.lang.tokens import TokBlock, parse_tokens
  main, forks = [], []
  for seg in parse_tokens(ids, vocab):
    if isinstance(seg, TokBlock):
      forks.append(list(seg.content) + [VOCAB.async_close])
    else:
      main += list(seg.all_ids)
  return [main + [EOS]] + forks


# A hand-checked answer (see test_lang_layout): a P t L10 [A x /A] b P L20 [A y z /A] S c P L10 [A w /A] d
a, b, c, d, t, w, x, y, z = range(70, 79)
_V = VOCAB
HAND_ANSWER = [a, _V.promise, t, _V.length_token(10), _V.async_open, x, _V.async_close,
               b, _V.promise, _V.length_token(20), _V.async_open, y, z, _V.async_close,
               _V.sync, c, _V.promise, _V.length_token(10), _V.async_open, w, _V.async_close, d]


@functools.cache
def replay(mode: str = "pred", lanes: int = 8):
  """A fixed batch of answers (hand-checked, edge cases, random; in `vocab_for(mode)`) and their forced
  replays in that position mode, computed once."""
  rng = np.random.default_rng(7)
  empty_block = [VOCAB.promise, VOCAB.length_token(10), VOCAB.async_open, VOCAB.async_close]
  two_long = [_V.promise, _V.length_token(10), _V.async_open] + [x] * 10 + [_V.async_close]
  two_long += [_V.promise, _V.length_token(10), _V.async_open] + [y] * 10 + [_V.async_close, _V.sync, a]
  answers = [HAND_ANSWER, [], [70], [VOCAB.sync], empty_block, two_long]
  answers += [token_program(rng) for _ in range(16)]
  answers = [in_vocab(answer, vocab_for(mode)) for answer in answers]
  prompt_batch = [[BOS] + rng.integers(64, 128, size=int(rng.integers(0, 3))).tolist() for _ in answers]
  return prompt_batch, answers, run_forced(prompt_batch, answers, mode, lanes)


def run_forced(prompt_batch: list[list[int]], answers: list[list[int]], mode: str = "pred", lanes: int = 8):
  """Replays the answers (in `vocab_for(mode)`, tagged as the mode trains them) through the jitted
  interpreter (enough lanes: no stalls); one compile per call."""
  from pasta_jax.decode.config import InterpreterConfig
  from pasta_jax.decode.loop import run_interpreter
  from pasta_jax.decode.toy_model import ToyConfig, toy_apply, toy_params
  from pasta_jax.lang.layout import answer_for_mode
  vocab = vocab_for(mode)
  toy = ToyConfig(vocab_size=1536 if vocab is EXACT_VOCAB else 128)
  cfg = InterpreterConfig(vocab=vocab, lanes=lanes, max_threads=16, pool_slots=256, max_steps=512,
                          position_mode=mode)
  pool_spec = (toy.num_layers, toy.num_kv_heads, toy.head_dim, np.float32)
  scripts = [scripts_of(answer_for_mode(a, vocab, mode), vocab) for a in answers]
  return run_interpreter(toy_apply, toy_params(toy, {}), prompt_batch, cfg, vocab_size=toy.vocab_size,
                         pool_spec=pool_spec, scripts=scripts)
