"""The forced-replay benches' flags and answers (bench.interpreter, .baselines, .scoped): LIMA-style records whose
chat prompt falls in one padded length, their answers cut to a token budget."""

from __future__ import annotations

from pasta_jax.data.sources import read_records
from pasta_jax.decode import api
from pasta_jax.decode.loop import bucket


def add_replay_flags(parser, limit: int, data: str = "lima") -> None:
  """The flags of the forced-replay benches over LIMA-style answers (bench.interpreter, .baselines, .scoped)."""
  parser.add_argument("--data", default=data, help="a shared dataset name or a JSONL path")
  parser.add_argument("--limit", type=int, default=limit)
  parser.add_argument("--answer-tokens", type=int, default=200, help="truncate answers to their first N tokens")
  parser.add_argument("--new-tokens", type=int, default=256, help="step budget (fixed: one compile)")
  parser.add_argument("--prompt-bucket", type=int, default=64, help="use prompts of this padded length only")
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--model", default=None, help="model path (default: the embedded Gemma 3 270M)")


def replay_answers(model, path: str, answer_tokens: int, prompt_bucket: int):
  """(id, prompt, prompt ids, answer cut to its first `answer_tokens` tokens) for each record of `path` whose chat
  prompt pads to `prompt_bucket` tokens (one prompt shape: one compile per loop)."""
  lang = api.LangTokenizer(model.tokenizer)
  for row in read_records(path):
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    ids = api.prompt_ids(model.tokenizer, [prompt], chat=True)[0]
    if bucket(len(ids)) == prompt_bucket:
      yield row["id"], prompt, ids, lang.decode(lang.encode(row["output"])[:answer_tokens])


def first(items, limit: int, none_found: str):
  """The first `limit` items; exits with `none_found` when there is none (e.g. a tokenizer that splits words
  puts every prompt in a bigger bucket)."""
  found = 0
  for item in items:
    yield item
    found += 1
    if found == limit:
      return
  if found == 0:
    raise SystemExit(none_found)
