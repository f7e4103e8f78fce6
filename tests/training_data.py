"""A small PASTA-annotated training set for the trainer tests (tiny char-level model)."""

from __future__ import annotations

from pasta_jax.data.encode import EncodeConfig, encode_example
from pasta_jax.lang.layout import stack_layouts

ENCODE = EncodeConfig(seq_len=112, num_threads=4)


def records(count: int = 16) -> list[dict]:
  out = []
  for i in range(count):
    annotated = (f'Items:<promise topic="a" tokens="10"/><async>one {i}</async>'
                 f'<promise topic="b" tokens="10"/><async>two {i % 3}</async><sync/>end {i}')
    out.append({"id": str(i), "instruction": f"List {i}", "annotated": annotated})
  return out


def batches(tokenizer, batch_size: int = 4, count: int = 16, encode: EncodeConfig = ENCODE) -> list:
  """A list is a valid StepDataset: batch k is examples [k*B, (k+1)*B)."""
  vocab = tokenizer.tag_vocab()
  layouts = [encode_example(r, tokenizer, vocab, encode) for r in records(count)]
  return [stack_layouts(layouts[i:i + batch_size]) for i in range(0, count - batch_size + 1, batch_size)]
