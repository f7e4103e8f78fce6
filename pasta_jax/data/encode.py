"""One instruction record -> one padded PASTA training layout (the unit every data pipeline maps).

Records are dicts with `instruction`, optional `input`, and the answer: `annotated` (promise-form
PASTA-LANG text, the Pasta-SFT field) or `output` (the source answer). Objectives:
  sft           the annotated answer laid out with the PASTA mask and positions;
  baseline_sft  the same answer with every tag stripped, re-tokenized as plain text, causal;
  apar_sft      the record's `apar` answer (APAR text form, data/apar_format.py) laid out with APAR's
                mask and exact path positions (lang/apar_layout.py); without one, `output` as a
                single node (APAR's negative examples).
  scoped_sft    the record's `scoped` answer (the earlier paper's scoped form, lang/scoped.py) laid out
                with its synchronous prefixes as mask and positions (lang/scoped_layout.py); without one,
                `output` as a plain answer.
Prompts use Gemma's chat turns; the answer ends with `<end_of_turn>` (the chat end id).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pasta_jax.decode.api import LangTokenizer, chat_text
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang.layout import Layout, PositionMode, layout_example, pad_layout, plain_layout
from pasta_jax.lang.tags import TagVocab
from pasta_jax.lang.text import strip_tags
from pasta_jax.lang.tokens import encode_answer


class ExampleTooLong(PastaError):
  """The laid-out example needs more tokens or threads than the configured shape."""


@dataclasses.dataclass(frozen=True)
class EncodeConfig:
  seq_len: int | None = 1024  # None: the example's own length, unpadded (reference log-probs)
  num_threads: int | None = 16  # None: the example's own thread count
  position_mode: PositionMode = "pred"
  objective: str = "sft"  # "sft" | "baseline_sft" | "apar_sft" | "scoped_sft"
  chat: bool = True


def record_prompt(record: Mapping[str, Any]) -> str:
  """The user turn of an instruction record: instruction, then its input if any."""
  instruction = str(record.get("instruction") or "").strip()
  extra = str(record.get("input") or "").strip()
  if not instruction:
    raise PastaError(f"record {record.get('id', '?')!r} has no instruction")
  return f"{instruction}\n\n{extra}" if extra else instruction


def record_answer(record: Mapping[str, Any], objective: str) -> str:
  """Promise-form answer for sft; the tag-free text for baseline_sft."""
  answer = record.get("annotated") or record.get("output")
  if not answer:
    raise PastaError(f"record {record.get('id', '?')!r} has neither 'annotated' nor 'output'")
  return strip_tags(answer) if objective == "baseline_sft" else answer


def end_id(tokenizer, vocab: TagVocab, chat: bool) -> int:
  if chat and hasattr(tokenizer, "token_to_id"):
    end_of_turn = tokenizer.token_to_id("<end_of_turn>")
    if end_of_turn is not None:
      return int(end_of_turn)
  return int(vocab.eos_ids[0])


def prompt_token_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
  return tokenizer.encode(chat_text(tokenizer, prompt) if chat else prompt, add_bos=True)


def encode_example(record: Mapping[str, Any], tokenizer, vocab: TagVocab, config: EncodeConfig) -> Layout:
  """The padded [seq_len] layout of one record. Raises TagError (bad tags) or ExampleTooLong."""
  prompt = prompt_token_ids(tokenizer, record_prompt(record), config.chat)
  lang = LangTokenizer(tokenizer)
  end = end_id(tokenizer, vocab, config.chat)
  if config.objective == "apar_sft":
    from pasta_jax.decode.apar_text import encode_apar_text
    from pasta_jax.lang.apar_layout import apar_layout
    text = record.get("apar") or record.get("output") or ""
    tree_ids = encode_apar_text(text, lang, vocab, f"record {record.get('id', '?')!r}: ", end_id=end)
    return fit_layout(apar_layout(prompt, tree_ids, vocab, eos_id=end), config, str(record.get("id", "?")))
  if config.objective == "scoped_sft":
    from pasta_jax.lang import scoped
    from pasta_jax.lang.scoped_layout import scoped_layout
    text = record.get("scoped") or record.get("output") or ""
    try:
      ids = scoped.encode(scoped.parse(text), lang.encode, vocab)
    except TagError as err:
      raise TagError(f"record {record.get('id', '?')!r}: {err}") from None
    return fit_layout(scoped_layout(prompt, ids, vocab, eos_id=end), config, str(record.get("id", "?")))
  answer_text = record_answer(record, config.objective)
  if config.objective == "baseline_sft":
    layout = plain_layout(prompt, lang.encode(answer_text), end)
  else:
    layout = layout_example(prompt, encode_answer(answer_text, lang, vocab), vocab, mode=config.position_mode,
                            eos_id=end)
  return fit_layout(layout, config, str(record.get("id", "?")))


def encode_ids(prompt: str, answer_ids: Sequence[int], tokenizer, vocab: TagVocab, config: EncodeConfig,
               where: str = "?") -> Layout:
  """The padded layout of an answer given as token ids (a sampled answer, exactly as it was decoded:
  re-tokenizing its text could split it differently and change log p(y|x))."""
  prompt_ids = prompt_token_ids(tokenizer, prompt, config.chat)
  layout = layout_example(prompt_ids, answer_ids, vocab, mode=config.position_mode,
                          eos_id=end_id(tokenizer, vocab, config.chat))
  return fit_layout(layout, config, where)


def fit_layout(layout: Layout, config: EncodeConfig, where: str) -> Layout:
  seq_len = layout.length if config.seq_len is None else config.seq_len
  num_threads = layout.num_threads if config.num_threads is None else config.num_threads
  if layout.length > seq_len or layout.num_threads > num_threads:
    raise ExampleTooLong(f"record {where!r} needs {layout.length} tokens x {layout.num_threads} "
                         f"threads; the configured shape is {seq_len} x {num_threads}")
  return pad_layout(layout, seq_len, num_threads)
