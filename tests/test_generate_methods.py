"""One public entry, `api.generate(model, prompts, method=...)`, for every method of the one decode core.

On a tiny random Gemma with a character-level tokenizer: every method returns the one `Result` type;
forced replays of the same text agree across methods; sequential decoding equals the PASTA rules on an
untagged answer; `stream` ends with exactly what `generate` returns and shows the run growing chunk by
chunk; `return_logits` gives the logits behind every record; the compile cache stays bounded.
"""

from __future__ import annotations

import numpy as np
import pytest

from pasta_jax.decode import api
from pasta_jax.decode.result import Result
from pasta_jax.decode.rules import AparRules, PastaRules, SequentialRules, SotRules
from pasta_jax.errors import PastaError
from pasta_jax.lang.text import strip_tags
from pasta_jax.methods import Apar, Pasta, Sequential, Sot, generate, generate_ids, prepare_run, stream
from tests.tiny import tiny_model

PASTA = ('Two tips:\n<promise topic="sleep" tokens="20"/><async>- Sleep eight hours.\n</async>'
         '<promise topic="food" tokens="10"/><async>- Eat greens.\n</async><sync/>Done.')
APAR = "Two tips:\n<fork/><child>- Sleep eight hours.\n</child><fork/><child>- Eat greens.\n</child>Done."


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def test_every_method_returns_the_one_result_type(model):
  plain = strip_tags(PASTA)
  runs = {"pasta": generate(model, ["q"], Pasta(lanes=4), forced_answers=[PASTA])[0],
          "apar": generate(model, ["q"], Apar(lanes=4), forced_answers=[APAR])[0],
          "sequential": generate(model, ["q"], Sequential(), forced_answers=[plain])[0]}
  for method, result in runs.items():
    assert isinstance(result, Result) and result.method == method and result.finished, method
  assert runs["pasta"].text == plain and runs["sequential"].text == plain
  assert runs["apar"].text == APAR.replace("<fork/>", "").replace("<child>", "").replace("</child>", "")
  assert runs["sequential"].steps > runs["pasta"].steps  # one lane: every token in turn
  assert len(runs["apar"].thread_texts) == 3 and runs["apar"].parents[1] == 0


def test_sequential_rules_decode_like_pasta_rules_on_one_lane(model):
  """Free greedy decoding of the random model: whatever it writes, the sequential rules and PASTA's
  rules (which never fork here) must agree token for token until an end or a tag token."""
  [seq] = generate(model, ["hello"], Sequential(), max_new_tokens=24)
  [pasta] = generate(model, ["hello"], Pasta(lanes=1), max_new_tokens=24)
  vocab = model.tokenizer.tag_vocab()
  seq_tokens, pasta_tokens = seq.records[:, 3].tolist(), pasta.records[:, 3].tolist()
  cut = next((i for i, t in enumerate(seq_tokens) if t in vocab.tag_ids), len(seq_tokens))
  assert seq_tokens[:cut] == pasta_tokens[:cut] and cut > 4


def test_stream_ends_with_what_generate_returns(model):
  chunks = list(stream(model, ["q"], Pasta(lanes=4), forced_answers=[PASTA], chunk_steps=5))
  [whole] = generate(model, ["q"], Pasta(lanes=4), forced_answers=[PASTA])
  sizes = [len(c[0].records) for c in chunks]
  assert len(chunks) >= 3 and sizes == sorted(sizes) and sizes[0] == 1  # after prefill: main's first token
  final = chunks[-1][0]
  assert final.finished and final.text == whole.text and final.steps == whole.steps
  np.testing.assert_array_equal(final.records, whole.records)
  assert not chunks[-2][0].finished


def test_return_logits_are_the_logits_behind_each_record(model):
  [result] = generate(model, ["hello"], Sequential(), max_new_tokens=12, return_logits=True)
  assert result.logits.shape == (len(result.records), model.config.vocab_size)
  np.testing.assert_array_equal(result.logits.argmax(axis=-1), result.records[:, 3])  # greedy, no constraint


def test_bad_methods_and_settings_are_named(model):
  with pytest.raises(PastaError, match="unknown method 'eagle'"):
    generate(model, ["q"], "eagle")
  with pytest.raises(PastaError, match="sot.*point prompts"):
    generate(model, ["q"], Sot())
  with pytest.raises(PastaError, match="tag-free"):
    generate(model, ["q"], Sequential(), forced_answers=[PASTA])
  with pytest.raises(TypeError, match="ignore_eos"):  # an option the method does not have
    generate_ids(model, [[2, 3]], Pasta(ignore_eos=True))
  with pytest.raises(PastaError, match="method 'pasta': lanes must be at least 1"):
    Pasta(lanes=0)


def test_rules_refuse_settings_they_cannot_honour(model):
  from pasta_jax.decode.config import InterpreterConfig
  vocab = model.tokenizer.tag_vocab()
  with pytest.raises(ValueError, match="one lane"):
    InterpreterConfig(vocab=vocab, lanes=2, rules=SequentialRules())
  with pytest.raises(ValueError, match="initial_threads must be 1"):
    InterpreterConfig(vocab=vocab, lanes=4, rules=PastaRules(initial_threads=2))
  with pytest.raises(ValueError, match="max_depth"):
    InterpreterConfig(vocab=vocab, rules=AparRules(max_depth=-1))
  with pytest.raises(ValueError, match="initial_threads"):
    InterpreterConfig(vocab=vocab, lanes=2, rules=SotRules(initial_threads=3))
  with pytest.raises(ValueError, match="rules must be"):
    InterpreterConfig(vocab=vocab, rules="apar")


def test_compile_cache_is_bounded(model):
  cache = api.CompileCache(maxsize=1)
  for budget in (8, 40):  # two pool buckets: two compiled loops, the first pushed out
    cache.get(prepare_run(model, [[2, 3]], Sequential(), max_new_tokens=budget), api.loop.prefill_and_run)
  assert len(cache.entries) == 1 and next(iter(cache.entries))[2].max_content == 40  # the newer one kept
