"""Streamed text is the result's text: for every method that streams, wherever the chunks end, the text handed out
chunk by chunk joins into exactly the final `Result.text`. Both paths: `pasta serve` (`decode.streaming.settled_text`
of a request's records after each chunk, then the result's text) and `pasta_jax.stream` / `pasta generate` (each
partial result's text, then the last one's). Text already sent cannot be taken back, so every settled text must
extend the one before and be a prefix of the final text, whatever tags the model writes (a PASTA-trained model
decoded by a method that never forks writes promises whose blocks nobody writes) and however a detokenizer merges
the ids decoded together.

Chunkings are drawn by hypothesis over runs drawn by hypothesis (records built here, a detokenizer with byte
pieces) and over real runs of the tiny random Gemma, its logits bent so that it writes tags often."""

from __future__ import annotations

import contextlib
import functools
import io

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pasta_jax.commands import generate as generate_command
from pasta_jax.commands.pasta_view import Run
from pasta_jax.decode import api, streaming
from pasta_jax.decode.loop import RunOutput
from pasta_jax.decode.result import pasta_result
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.speculation import Drafter
from pasta_jax.decode.state import STEP
from pasta_jax.decode.tokenizing import LangTokenizer
from pasta_jax.methods import Medusa, Pasta, PastaTrees, Sequential, registry, stream_ids
from pasta_jax.model import medusa
from tests.marks import HEAVY
from tests.tiny import BYTE_BASE, TEXT_BASE, BytePieces, CharTokenizer, biased_model_fn, tiny_model

VOCAB = CharTokenizer().tag_vocab()
EOS = VOCAB.eos_ids[0]


TOKENIZER = BytePieces()
CHARS = [TEXT_BASE + ord(c) for c in 'ab <s>"/']
BYTES = [BYTE_BASE + b for b in (0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0x80)]  # é = C3 A9, € = E2 82 AC
TAGS = [VOCAB.promise, VOCAB.lengths[0], VOCAB.lengths[1], VOCAB.async_open, VOCAB.async_close, VOCAB.sync,
        VOCAB.apar_fork, VOCAB.scope_open]
ANY_IDS = st.sampled_from(CHARS * 2 + BYTES + TAGS + [EOS])
TEXT = st.lists(st.sampled_from(CHARS * 3 + BYTES), min_size=1, max_size=4)
PROMISE = st.builds(lambda topic, length: [VOCAB.promise, *topic, length],  # `<promise topic="..." tokens="N"/>`
                    st.lists(st.sampled_from(CHARS * 4 + [VOCAB.sync, VOCAB.promise]), max_size=3),
                    st.sampled_from(VOCAB.lengths[:2]))
MAIN = st.lists(st.one_of(TEXT, PROMISE, PROMISE, st.lists(ANY_IDS, min_size=1, max_size=2)), max_size=8).map(
    lambda parts: [t for part in parts for t in part])
FORK_IDS = st.sampled_from(CHARS * 3 + BYTES + [VOCAB.sync, VOCAB.scope_open, EOS])


def final_text(records: np.ndarray, tokenizer=TOKENIZER) -> str:
  """The text the run's result has: the one function every streaming method builds its result with."""
  main = records[records[:, 2] == 0, 3]
  run = RunOutput(records, None, int(records[:, STEP].max()) + 1, 0, bool(len(main) and main[-1] == EOS), False)
  return pasta_result(run, 0.0, tokenizer, VOCAB).text


def server_stream(records: np.ndarray, boundaries, tokenizer=TOKENIZER) -> str:
  """What `pasta serve` hands out: the settled text's new part after each chunk ending at one of `boundaries`
  (steps), then the final text's; a text that does not extend what was sent fails (the engine counts a seam)."""
  sent = ""
  for step in sorted(set(boundaries)):
    new = streaming.delta(sent, streaming.settled_text(records[records[:, STEP] <= step], tokenizer, VOCAB, True))
    assert new is not None, (step, sent)
    sent += new
  new = streaming.delta(sent, final_text(records, tokenizer))
  assert new is not None, sent
  return sent + new


@st.composite
def drawn_runs(draw) -> np.ndarray:
  """Records of a run: main's ids, each step recording one or more of them (a tree method's accepted path), and
  either no forks (sequential, Medusa) or PASTA's: the fork of main's k-th LENGTH records its `<async>` in the step
  that feeds the LENGTH (main's next id is recorded in that step too), then its ids, closed or cut off."""
  main = draw(MAIN)
  main = main[:main.index(EOS) + 1] if EOS in main else main + draw(st.sampled_from([[], [EOS]]))
  forks = draw(st.booleans())
  rows, step, fork = [], 0, 0
  for k, token in enumerate(main):
    step += 1 if k and (VOCAB.is_length(main[k - 1]) or draw(st.booleans())) else 0
    rows.append((step, 0, 0, token))
    if forks and VOCAB.is_length(token) and k + 1 < len(main):
      fork += 1
      block = [VOCAB.async_open, *draw(st.lists(FORK_IDS, max_size=8))]
      block += [VOCAB.async_close] if draw(st.booleans()) else []
      at = step + 1
      for token in block:
        rows.append((at, fork, fork, token))
        at += int(token == VOCAB.async_open or draw(st.booleans()))
  if not rows:
    rows = [(0, 0, 0, CHARS[0])]
  rows.sort(key=lambda r: r[0])
  return np.asarray([(s, lane, u, t, i) for i, (s, lane, u, t) in enumerate(rows)], np.int32)


@settings(max_examples=400, deadline=None)
@given(records=drawn_runs(), data=st.data())
def test_drawn_runs_stream_their_result_text_for_any_chunking(records, data):
  steps = sorted(set(records[:, STEP].tolist()))
  boundaries = data.draw(st.lists(st.sampled_from(steps)), label="chunk ends")
  assert server_stream(records, boundaries) == final_text(records)


def sequential_records(*pieces) -> np.ndarray:
  """Main's records, one id a step: strings are text (one id per character), ints are ids."""
  ids = [t for p in pieces for t in (CharTokenizer().encode(p, add_bos=False) if isinstance(p, str) else [p])]
  return np.asarray([(k, 0, 0, t, k) for k, t in enumerate(ids)], np.int32)


def test_a_promise_is_never_streamed_and_main_goes_on_past_one_with_no_fork():
  """The reported shape: a PASTA model decoded sequentially writes `1. <promise topic="Set aside a" .../>2. ...`;
  no fork writes the block, so the result's text is `1. 2. ...`. Streamed, no prefix may show the promise's tag or
  topic, and the text after the promise streams before the run ends."""
  length = VOCAB.lengths[0]
  records = sequential_records("Tips:\n\n1. ", VOCAB.promise, "Set aside a", length, "2. ", VOCAB.promise,
                               "Take breaks", length, "3. Set realistic goals.", EOS)
  final = final_text(records)
  assert final == "Tips:\n\n1. 2. 3. Set realistic goals."
  texts = [streaming.settled_text(records[:n], TOKENIZER, VOCAB, True) for n in range(1, len(records) + 1)]
  for before, text in zip(["", *texts], texts, strict=False):
    assert text.startswith(before) and final.startswith(text) and "<" not in text and "Set aside" not in text
  assert texts[-1] == "Tips:\n\n1. 2. 3. Set realistic goals"  # streamed before the end, the last id held back
  assert server_stream(records, range(len(records))) == final


@pytest.mark.parametrize("topic", ['Use "Pomodoro"', "a<b"])
@pytest.mark.parametrize("later", ["", "and more."])
def test_after_a_promise_whose_tag_does_not_read_back_nothing_streams(topic, later):
  """A topic holding `"`, `<` or `>` renders as a tag that does not read back as one: the result keeps it as plain
  text where the rest of the answer reads back, and drops it where a later promise with no block does not. Which,
  only the end says: nothing after such a promise streams before it."""
  tail = [VOCAB.promise, "x", VOCAB.lengths[0], later] if later else []
  records = sequential_records("1. ", VOCAB.promise, topic, VOCAB.lengths[0], "2. Set goals. ", *tail, EOS)
  final = final_text(records)
  assert (topic in final) == (not later) and final.startswith("1. ")
  texts = [streaming.settled_text(records[:n], TOKENIZER, VOCAB, True) for n in range(1, len(records) + 1)]
  assert texts[-1] == "1. " and server_stream(records, range(len(records))) == final


def test_text_that_ids_decoded_together_may_change_waits():
  """Byte pieces: `é` (C3 A9) streams once a later id closes its bytes, and never a byte the next id may change."""
  c3, a9, e2, x82, ac, x80 = BYTES
  records = sequential_records("a", c3, a9, x80, "b")  # a stray byte after `é` makes marks of all three
  assert server_stream(records, range(len(records))) == final_text(records) == "a\ufffd\ufffd\ufffdb"
  records = sequential_records("a", c3, a9, "b", e2, x82, ac, "c", c3, EOS)
  texts = [streaming.settled_text(records[:n], TOKENIZER, VOCAB, True) for n in range(1, len(records) + 1)]
  assert texts == ["", "a", "a", "a", "aéb", "aéb", "aéb", "aéb", "aéb€c", "aéb€c"]  # the last id is held back
  assert final_text(records) == "aéb€c\ufffd"  # the final text is handed out whole, a cut character too
  assert server_stream(records, range(len(records))) == "aéb€c\ufffd"


# --- real runs of the tiny Gemma, for every method that streams ---------------------------------------------------
MODEL = tiny_model()
PROMPTS = ["Tell me a tea.", "x"]
HEADS = Drafter(medusa.init_heads(medusa.MedusaConfig(num_heads=1), MODEL.params["params"]["embedder"]),
                medusa.MedusaConfig(num_heads=1), np.full((1, 8), 0.3, np.float32))
STREAMING = {"sequential": Sequential(), "pasta": Pasta(lanes=2, max_threads=8),
             "medusa": Medusa(heads=HEADS, tree_size=2),
             "pasta+medusa": PastaTrees(lanes=2, max_threads=8, heads=HEADS, tree_size=2)}
SAMPLING = SamplingConfig(temperature=1.0, seed=5)


def tag_writing_logits() -> np.ndarray:
  """[V, V] logit biases by the input token, under which the tiny model writes the shape of a PASTA answer (its own
  logits, scaled down, still choose among what each allows): text of a few characters, promises with a short topic
  (of `T`s) and a LENGTH, `<sync/>`, a fork's `</async>`, and an end."""
  text = [TEXT_BASE + ord(c) for c in "ab "]
  topic = TEXT_BASE + ord("T")
  bias = np.full((MODEL.config.vocab_size, MODEL.config.vocab_size), -50.0, np.float32)
  bias[:, text] = 1.0  # after text (and the prompt, and any tag): text, or a tag
  bias[:, [VOCAB.promise, VOCAB.sync, VOCAB.async_close, EOS]] = [0.3, -1.0, 0.0, -2.5]
  bias[VOCAB.promise] = -50.0
  bias[VOCAB.promise, topic] = 3.0  # a promise's topic: some `T`s, then its LENGTH
  bias[topic] = -50.0
  bias[topic, [topic, VOCAB.lengths[0], VOCAB.lengths[1]]] = [0.0, 1.0, 0.5]
  return bias


@pytest.fixture(scope="module")
def streamed():
  """Per streaming method, `stream_ids`'s partial results at every step (chunks of one step: any chunking's are a
  subset of them) for both prompts. The tiny model's logits are bent to write tags (a wrapped model function), and
  the loops compile without lane buckets (fewer programs)."""
  assert set(STREAMING) == set(registry.names(stream=True))
  bias, original, prepare = jnp.asarray(tag_writing_logits()), api.model_fn, api.prepare

  bent = biased_model_fn(original, bias)

  ids = [MODEL.tokenizer.encode(p) for p in PROMPTS]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(api, "model_fn", bent)
    patch.setattr(api, "prepare", functools.partial(prepare, lane_buckets=False))
    out = {name: list(stream_ids(MODEL, ids, method, chunk_steps=1, max_new_tokens=24, sampling=SAMPLING))
           for name, method in STREAMING.items()}
  for name, chunks in out.items():  # the runs exercise what they should: promises, forks where the method forks,
    records = [r.records for r in chunks[-1]]  # and text streamed past a promise before the run ends
    assert any((r[:, 3] == VOCAB.promise).sum() >= 2 for r in records), name
    assert any(r[:, 2].max() > 0 for r in records) == name.startswith("pasta"), name
    assert any(len(c[row].text) > len(text_before_promises(r)) for row, r in enumerate(records) for c in chunks[:-1])
  return out


def text_before_promises(records: np.ndarray) -> str:
  main = records[records[:, 2] == 0, 3].tolist()
  return MODEL.tokenizer.decode(main[:main.index(VOCAB.promise)] if VOCAB.promise in main else main)


def test_no_partial_result_shows_a_tag_or_a_topic(streamed):
  """The reported failure: a partial result whose records end inside a promise (`<promise topic="T` so far) showed
  the promise as text. The runs' text is `a`, `b` and spaces: a `<` is a tag, a `T` a topic."""
  for name, chunks in streamed.items():
    for chunk in chunks:
      for result in chunk:
        assert "<" not in result.text and "T" not in result.text, (name, result.text, result.annotated)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(STREAMING)), row=st.sampled_from(range(len(PROMPTS))), data=st.data())
def test_stream_yields_texts_that_join_into_the_result_text(streamed, name, row, data):
  """`pasta_jax.stream`: each partial result's text extends the one before, whichever of them a chunking yields."""
  chunks = streamed[name]
  shown = data.draw(st.lists(st.sampled_from(range(len(chunks) - 1))), label="chunk ends")
  final = chunks[-1][row]
  sent = ""
  for k in sorted(set(shown)) + [len(chunks) - 1]:
    new = streaming.delta(sent, chunks[k][row].text)
    assert new is not None, (k, sent, chunks[k][row].text)
    sent += new
  assert sent == final.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(STREAMING)), row=st.sampled_from(range(len(PROMPTS))), data=st.data())
def test_served_settled_texts_join_into_the_result_text(streamed, name, row, data):
  """`pasta serve`: the settled text of the final records cut after any steps, then the result's text."""
  final = streamed[name][-1][row]
  steps = sorted(set(final.records[:, STEP].tolist()))
  boundaries = data.draw(st.lists(st.sampled_from(steps)), label="chunk ends")
  lang = LangTokenizer(MODEL.tokenizer)
  assert server_stream(final.records, boundaries, lang) == final.text == final_text(final.records, lang)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from([n for n, m in sorted(STREAMING.items()) if not m.capabilities.threads]),
       row=st.sampled_from(range(len(PROMPTS))), data=st.data())
def test_pasta_generate_prints_the_result_text(streamed, name, row, data):
  """`pasta generate`'s streaming print path (methods without threads: a threaded one prints its threads), fed the
  partial results of a drawn chunking: it prints the final text exactly."""
  chunks = [[c[row]] for c in streamed[name]]
  shown = sorted(set(data.draw(st.lists(st.sampled_from(range(len(chunks) - 1))), label="chunk ends")))
  run = Run(MODEL, [2], STREAMING[name], 24, SAMPLING, Runtime())
  out = io.StringIO()
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), \
       contextlib.redirect_stderr(io.StringIO()):
    patch.setattr(generate_command, "stream_ids", lambda *args, **kwargs: iter([chunks[k] for k in shown + [-1]]))
    assert generate_command.stream_answer(run) == 0
  assert out.getvalue() == chunks[-1][0].text


# --- the shipped default model: the reported prompts ------------------------------------------------------------
@HEAVY
@pytest.mark.parametrize("method", ["sequential", "medusa"])
def test_the_shipped_model_prints_its_answer_text(method, monkeypatch, capsys):
  """`pasta generate "..." --method sequential|medusa --max-new-tokens 64 --temperature 0` on the tuned default:
  the printed text is the final result's, with no promise tag or topic shown on the way."""
  from pasta_jax import cli
  yields = []

  def recorded(*args, **kwargs):
    for chunk in stream_ids(*args, **kwargs):
      yields.append(chunk[0])
      yield chunk

  monkeypatch.setattr(generate_command, "stream_ids", recorded)
  for prompt in ["What are some ways to improve my time management?", "How do I become more productive at work?"]:
    yields.clear()
    assert cli.main(["generate", prompt, "--method", method, "--max-new-tokens", "64", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed == yields[-1].text and "<promise" not in printed, printed
    assert "<promise" in yields[-1].annotated  # the model wrote promises that no fork keeps
