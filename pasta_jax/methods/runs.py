"""The public decode API: `generate(model, prompts, method)` -> one `Result` per prompt, and `stream` the same way.

`method` is a method name (its default options) or a method value such as `Pasta(lanes=4)` or
`Medusa(tree_size=8)` (this package: one file per method, `registry.METHODS` lists them). What every method
shares is a parameter here: the budget, sampling, chat turns, forced answers, logits on request, and the
`Runtime` (dtype, mesh, attention, output head). The method's one-time preparation (Medusa heads, ProPD's step
times, the n-gram index) is done here, once per model, as the CLI, `pasta eval` and `pasta serve` do it.
`generate_ids` and `stream_ids` take prompt token ids (BOS and chat turns already in), and raw per-thread
`scripts` to force.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from pasta_jax.decode import api, streaming
from pasta_jax.decode.api import GREEDY, Prepared, Result
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.tokenizing import LangTokenizer, prompt_ids
from pasta_jax.errors import PastaError
from pasta_jax.methods.base import Method, Setup
from pasta_jax.methods.registry import prepared, resolve

DEFAULT_RUNTIME = Runtime()
Sampling = SamplingConfig | Sequence[SamplingConfig]  # one for every prompt, or one per prompt


def generate(model, prompts: Sequence[str], method: str | Method = "pasta", *, max_new_tokens: int = 256,
             sampling: Sampling = GREEDY, chat: bool = True, forced_answers: Sequence[str] | None = None,
             return_logits: bool = False, runtime: Runtime = DEFAULT_RUNTIME) -> list[Result]:
  """Decodes each prompt (a batch; requests never interact) with `method` through the one interpreter.

  max_new_tokens: each answer's content-token budget (its text tokens; tags and topics are not counted).
  sampling: one `SamplingConfig` for every prompt, or one per prompt (temperature, top-k, top-p, repetition
  penalty and seed are each row's own; one compiled loop runs them all).
  chat: wrap each prompt in Gemma's chat turns (as the tuned models were trained).
  forced_answers: one per prompt, replayed instead of sampled, in the method's text form (promise form for
  "pasta", APAR's for "apar", the scoped form for "pasta-v0"); a malformed one raises TagError naming the place.
  Their length overrides max_new_tokens.
  return_logits: keep the logits behind every recorded token (`Result.logits`, [N, V]).
  """
  return generate_ids(model, _prompt_ids(model, prompts, chat, method), method, max_new_tokens=max_new_tokens,
                      sampling=sampling, forced_answers=forced_answers, return_logits=return_logits, runtime=runtime)


def generate_ids(model, ids: Sequence[Sequence[int]], method: str | Method = "pasta", *, max_new_tokens: int = 256,
                 sampling: Sampling = GREEDY, forced_answers: Sequence[str] | None = None, scripts=None,
                 return_logits: bool = False, runtime: Runtime = DEFAULT_RUNTIME) -> list[Result]:
  """`generate` on prompt token ids; `scripts`: per request, per thread token ids to force."""
  prep = prepare_run(model, ids, method, max_new_tokens=max_new_tokens, sampling=sampling,
                     forced_answers=forced_answers, scripts=scripts, return_logits=return_logits, runtime=runtime)
  runs, seconds = api.run_prepared(prep)
  lang = LangTokenizer(model.tokenizer)
  return [api.to_result(r, seconds, lang, prep) for r in runs]


def stream(model, prompts: Sequence[str], method: str | Method = "pasta", *, chunk_steps: int = 16,
           max_new_tokens: int = 256, sampling: Sampling = GREEDY, chat: bool = True,
           forced_answers: Sequence[str] | None = None, runtime: Runtime = DEFAULT_RUNTIME) -> Iterator[list[Result]]:
  """`generate`, yielding every request's result so far after prefill and after each chunk of `chunk_steps`
  steps (the loop state stays on device between chunks). The last yield is final; before it, each result's `text`
  is the answer's settled text (`decode.streaming`), which only grows and is a prefix of the final text: for a
  method that settles only at the end (`Capabilities.stream` False) it is "" until then."""
  return stream_ids(model, _prompt_ids(model, prompts, chat, method), method, chunk_steps=chunk_steps,
                    max_new_tokens=max_new_tokens, sampling=sampling, forced_answers=forced_answers, runtime=runtime)


def stream_ids(model, ids: Sequence[Sequence[int]], method: str | Method = "pasta", *, chunk_steps: int = 16,
               max_new_tokens: int = 256, sampling: Sampling = GREEDY,
               forced_answers: Sequence[str] | None = None, scripts=None,
               runtime: Runtime = DEFAULT_RUNTIME) -> Iterator[list[Result]]:
  """`stream` on prompt token ids."""
  if chunk_steps < 1:
    raise PastaError(f"chunk_steps must be at least 1, got {chunk_steps}")
  prep = prepare_run(model, ids, method, max_new_tokens=max_new_tokens, sampling=sampling,
                     forced_answers=forced_answers, scripts=scripts, runtime=runtime)
  lang, streams = LangTokenizer(model.tokenizer), resolve(method).capabilities.stream
  return api.stream_prepared(prep, lang, chunk_steps,
                             settled=lambda records: streaming.settled_text(records, lang, prep.vocab, streams))


def prepare_run(model, ids: Sequence[Sequence[int]], method: str | Method = "pasta", *, max_new_tokens: int = 256,
                sampling: Sampling = GREEDY, forced_answers: Sequence[str] | None = None, scripts=None,
                return_logits: bool = False, runtime: Runtime = DEFAULT_RUNTIME, **engine) -> Prepared:
  """The prepared run of `method` on `ids`: the method prepared for `model` (once), its request checks, its forced
  answers as scripts, its layout. `engine`: `api.prepare`'s engine options (lane_buckets, pool_tokens,
  defer_kv_writes), for benches and tests."""
  if model.tokenizer is None:
    raise PastaError("this model has no tokenizer; decoding needs one for its tags and end ids")
  if forced_answers is not None and scripts is not None:
    raise PastaError("give forced_answers or scripts, not both")
  if forced_answers is not None and len(forced_answers) != len(ids):
    raise PastaError(f"got {len(forced_answers)} forced answers for {len(ids)} prompts")
  forced = forced_answers is not None or scripts is not None
  method = prepared(method, model, Setup(ids, max_new_tokens, runtime))
  for each in set(api.per_prompt_sampling(sampling, len(ids))):
    method.check_request(sampling=each, runtime=runtime, forced=forced)
  if forced_answers is not None:
    scripts = method.scripts(forced_answers, model)
  layout = method.layout(model, scripts)
  prep = api.prepare(model, ids, rules=layout.rules, lanes=layout.lanes, max_threads=layout.max_threads,
                     rule_inputs=layout.rule_inputs, max_new_tokens=max_new_tokens, sampling=sampling,
                     position_mode=method.position_mode, scripts=scripts, record_logits=return_logits,
                     runtime=runtime, build_result=method.build_result, **engine)
  return dataclasses.replace(prep, method=method.name)


def _prompt_ids(model, prompts: Sequence[str], chat: bool, method) -> list[list[int]]:
  if model.tokenizer is None:
    raise PastaError(f"this model has no tokenizer; {method} decoding needs one for its tags and end ids")
  return prompt_ids(model.tokenizer, prompts, chat)


__all__ = ["generate", "generate_ids", "prepare_run", "stream", "stream_ids"]
