"""PASTA-LANG text form: grammar, parse/render, strip_tags, the annotator converter, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasta_jax.errors import TagError
from pasta_jax.lang import text as T
from pasta_jax.lang.tags import round_length
from tests.lang_helpers import LOOKALIKES, char_count, exact_lengths, programs

EXAMPLE = ('Intro.\n<promise topic="length formula" tokens="40"/><async> The length is L = n.</async> Then '
           '<sync/> we use it.')


def test_parse_hand_example():
  assert T.parse(EXAMPLE) == [
      T.Text("Intro.\n"), T.Promise("length formula", 40), T.Block((T.Text(" The length is L = n."),)),
      T.Text(" Then "), T.Sync(), T.Text(" we use it.")]
  assert T.render(T.parse(EXAMPLE)) == EXAMPLE
  assert T.strip_tags(EXAMPLE) == "Intro.\n The length is L = n. Then  we use it."


def test_empty_and_tag_free():
  assert T.parse("") == []
  assert T.parse("just text") == [T.Text("just text")]
  assert T.parse('<promise topic="" tokens="10"/><async></async>') == [T.Promise("", 10), T.Block(())]


@pytest.mark.parametrize("lookalike", LOOKALIKES + [
    "if (a <promise) return;", "<p>HTML</p><br/>", "Promise<T> x = new Promise<T>();",
    '<promise topic="a<b" tokens="40"/>', '<promise topic="x" tokens="40" />', "<ASYNC>"])
def test_lookalikes_are_text(lookalike):
  text = f"before {lookalike} after"
  assert T.parse(text) == [T.Text(text)]
  assert T.strip_tags(text) == text


@given(programs())
@settings(max_examples=150, deadline=None)
def test_parse_render_identity(segments):
  text = T.render(segments)
  assert T.parse(text) == segments
  assert T.render(T.parse(text)) == text


@given(programs())
@settings(max_examples=100, deadline=None)
def test_strip_tags_is_exact(segments):
  expected = "".join(s.text for s in segments if isinstance(s, (T.Text, T.Block)))
  assert T.strip_tags(T.render(segments)) == expected
  assert T.strip_tags(segments) == expected


def error_at(text: str, offset: int, *words: str) -> str:
  with pytest.raises(TagError) as info:
    T.parse(text)
  message = str(info.value)
  assert f"(offset {offset})" in message, message
  assert repr(text[offset: offset + 40])[:-1] in message, message  # the excerpt starts at the place
  for word in words:
    assert word in message, message
  return message


P40 = '<promise topic="t" tokens="40"/>'


def test_error_unclosed_block():
  message = error_at(f"ab\ncd {P40}<async>never closed", 6 + len(P40), "unclosed")
  assert f"line 2, col {4 + len(P40)}" in message


def test_error_block_without_promise():
  error_at("text <async>x</async>", 5, "block without a promise")
  text = f"{P40}<async>x</async><async>y</async>"
  error_at(text, text.rindex("<async>"), "block without a promise")


def test_error_promise_without_block():
  error_at(f"a {P40} text", 2, "promise without a block")
  error_at(f"a {P40}", 2, "promise without a block", "ends")
  error_at(f"a {P40}{P40}<async>x</async>", 2, "promise without a block")
  error_at(f"a {P40}<sync/>", 2, "promise without a block")


def test_error_whitespace_between_promise_and_block():
  message = error_at(f"a {P40}\n<async>x</async>", 2 + len(P40), "directly", "whitespace")
  assert "(offset 2)" in message  # it names the promise too


@pytest.mark.parametrize("value,why", [("45", "multiple of 10"), ("0", "multiple of 10"),
                                       ("510", "multiple of 10"), ("forty", "not a plain decimal"),
                                       ("040", "not a plain decimal"), ("", "not a plain decimal"),
                                       (" 40", "not a plain decimal"),
                                       ("4e1", "not a plain decimal"), ("-10", "not a plain decimal")])
def test_error_bad_tokens(value, why):
  error_at(f'xy <promise topic="t" tokens="{value}"/><async>c</async>', 3, f'tokens="{value}"', why)


@given(tokens=st.integers(-5, 520), step=st.sampled_from([1, 10]))
def test_promise_lengths_parse_at_the_writers_granularity(tokens, step):
  """A Pred-1x model promises exact lengths (step 1), every other mode multiples of 10: each parses at its own step,
  in [step, 500], and nowhere else."""
  text = f'<promise topic="t" tokens="{tokens}"/><async>c</async>'
  valid = step <= tokens <= 500 and tokens % step == 0
  if valid:
    assert T.parse(text, length_step=step)[0] == T.Promise("t", tokens)
    T.check_segments(T.parse(text, length_step=step), length_step=step)
  else:
    with pytest.raises(TagError, match=f"multiple of {step}|not a plain decimal"):
      T.parse(text, length_step=step)
  if step == 1 and tokens % 10:  # an exact length the default (Pred-10x) grammar refuses
    with pytest.raises(TagError):
      T.parse(text)


@pytest.mark.parametrize("inner", ["<sync/>", "<async>", P40])
def test_error_nesting(inner):
  text = f"a {P40}<async>b {inner} c</async>"
  message = error_at(text, text.index(inner, 2 + len(P40) + 7), "nesting")
  assert f"(offset {2 + len(P40)})" in message  # where the block opened


def test_error_stray_close():
  error_at("a </async> b", 2, "stray </async>")
  error_at(f"{P40}<async>x</async></async>", len(P40) + 16, "stray")


def test_error_line_and_col_on_later_lines():
  message = error_at("line one\nline two\n  </async>", 20, "stray")
  assert "line 3, col 3" in message


# --- render / check_segments ------------------------------------------------------------------------------
@pytest.mark.parametrize("segments,words", [
    ([T.Promise("t", 40)], "promise without a block"),
    ([T.Promise("t", 40), T.Text("x")], "promise without a block"),
    ([T.Block((T.Text("x"),))], "block without a promise"),
    ([T.Text("x"), T.Block(())], "segment 1: block without a promise"),
    ([T.Promise("t", 45), T.Block(())], 'segment 0: bad tokens="45"'),
    ([T.Promise('a"b', 40), T.Block(())], "topic"),
    ([T.Text("a <sync/> b")], "spells the tag"),
    ([T.Promise("t", 40), T.Block((T.Text("</async>"),))], "spells the tag"),
    ([T.Promise("t", 40), T.Block((T.Sync(),))], "nesting"),
])
def test_render_rejects_bad_segments(segments, words):
  with pytest.raises(TagError, match=words):
    T.render(segments)


def test_normalize():
  segments = [T.Text(""), T.Text("a"), T.Text("b"), T.Promise("t", 10), T.Block((T.Text("x"), T.Text("y"))),
              T.Promise("u", 10), T.Block((T.Text(""),))]
  assert T.normalize(segments) == [T.Text("ab"), T.Promise("t", 10), T.Block((T.Text("xy"),)),
                                   T.Promise("u", 10), T.Block(())]


# --- the annotator's form ---------------------------------------------------------------------------------
PAPER_ORIGINAL = (
    "CDs (Compact Discs) came to the American market in 1983. This was made possible through a joint "
    "venture between CBS and Sony, named CBS/Sony Records, which was formed in March 1968. As Sony was one "
    "of the developers behind the compact disc digital music media, they built a compact disc production "
    "plant in Japan under this joint collaboration. This plant enabled CBS to supply some of the first "
    "compact disc releases for the American market in 1983.")
PAPER_ANNOTATED = (
    "CDs (Compact Discs) came to the American market in 1983. <async topic='\njoint venture'>This was made "
    "possible through a joint venture between CBS and Sony, named CBS/Sony Records, which was formed in "
    "March 1968.</async> <async topic\n='japan production plant'>As Sony was one of the developers behind "
    "the compact disc digital music media, they built a compact disc production plant in Japan under this "
    "joint collaboration. This plant enabled CBS to supply some of the first compact disc releases for the "
    "American market in 1983.</async>")


def test_converter_paper_example():
  converted = T.from_annotator_form(PAPER_ANNOTATED, char_count)
  block1 = ("This was made possible through a joint venture between CBS and Sony, named CBS/Sony Records, "
            "which was formed in March 1968.")
  segments = T.parse(converted)
  assert segments[:3] == [T.Text("CDs (Compact Discs) came to the American market in 1983. "),
                          T.Promise("joint venture", round_length(len(block1))), T.Block((T.Text(block1),))]
  assert segments[3] == T.Text(" ")
  assert segments[4].topic == "japan production plant"
  assert T.strip_tags(converted) == T.strip_annotator_tags(PAPER_ANNOTATED) == PAPER_ORIGINAL
  assert converted.startswith('CDs (Compact Discs) came to the American market in 1983. <promise '
                              f'topic="joint venture" tokens="{round_length(len(block1))}"/><async>This was')


@pytest.mark.parametrize("chars,tokens", [(0, 10), (4, 10), (14, 10), (15, 20), (24, 20), (25, 30),
                                          (499, 500), (900, 500)])
def test_converter_rounds_true_length(chars, tokens):
  content = "x" * chars
  converted = T.from_annotator_form(f"a <async topic='t'>{content}</async><sync/>b", char_count)
  assert converted == f'a <promise topic="t" tokens="{tokens}"/><async>{content}</async><sync/>b'


def test_converter_normalizes_tags_and_topics():
  annotated = """x<async  topic = "it's"  >one</async> <async topic='say "hi"'>two</async><sync />y"""
  converted = T.from_annotator_form(annotated, char_count)
  assert converted == ('x<promise topic="it\'s" tokens="10"/><async>one</async> '
                       '<promise topic="say \'hi\'" tokens="10"/><async>two</async><sync/>y')
  assert T.to_annotator_form(converted) == ("""x<async topic="it's">one</async> """
                                            """<async topic='say 'hi''>two</async><sync/>y""".replace(
                                                "'say 'hi''", '"say \'hi\'"'))


@given(programs())
@settings(max_examples=100, deadline=None)
def test_converter_round_trip(segments):
  # Topics as the converter writes them (whitespace runs collapsed, no outer spaces).
  segments = [T.Promise(T.clean_topic(s.topic), s.tokens) if isinstance(s, T.Promise) else s
              for s in segments]
  segments = exact_lengths(segments)
  promise_text = T.render(segments)
  texts = [s.text for s in segments if isinstance(s, (T.Text, T.Block))]
  if any(T.ANNOTATOR_PATTERN.search(t) for t in texts):  # e.g. "<sync />": a tag in the annotator's form
    with pytest.raises(TagError, match="annotator tag"):
      T.to_annotator_form(promise_text)
    return
  annotated = T.to_annotator_form(promise_text)
  assert T.from_annotator_form(annotated, char_count) == promise_text
  assert T.strip_annotator_tags(annotated) == T.strip_tags(promise_text)
  assert T.to_annotator_form(T.from_annotator_form(annotated, char_count)) == annotated


@pytest.mark.parametrize("text,offset,words", [
    ("a <async>b</async>", 2, "without a topic"),
    ("a <async topic='x'>b", 2, "unclosed"),
    ("a </async>", 2, "stray"),
    ("a <async topic='x'>b<async topic='y'>c</async></async>", 20, "nesting"),
    ("a <async topic='x'>b<sync/></async>", 20, "nesting"),
    ('a <promise topic="x" tokens="40"/>', 2, "promise-form tag"),
])
def test_converter_errors_name_the_place(text, offset, words):
  with pytest.raises(TagError, match=words) as info:
    T.from_annotator_form(text, char_count)
  assert f"(offset {offset})" in str(info.value)


@given(st.lists(st.sampled_from(list("ab <>/'\"=") + ["async", "sync", "topic", "promise", "tokens", "40"]),
                max_size=30).map("".join))
@settings(max_examples=200, deadline=None)
def test_parsers_never_crash(text):
  """Any text either parses or raises TagError, in both forms; what parses renders back exactly."""
  try:
    assert T.render(T.parse(text)) == text
  except TagError:
    pass
  try:
    T.from_annotator_form(text, char_count)
  except TagError:
    pass
