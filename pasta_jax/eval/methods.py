"""Decoding methods that `pasta eval` compares, as a small registry.

A method turns one prompt record into a `MethodOutput`. Every method here decodes through the one
PASTA interpreter (`pasta_jax.methods.generate`), greedy, batch 1, as the paper times both sides ("baseline
model time divided by test model time, both using the PASTA-LANG interpreter").

Every decoding method of the registry (`pasta_jax.methods.registry`) that decodes freely is an eval method of
the same name (`sequential` is the baseline). Each that annotates reference answers (`Capabilities.annotates`)
also gives `<name>-forced`: it replays the annotation of the record's reference answer, truncated to
--max-new-tokens, against its tag-free twin (`Method.tag_free_twin`, replayed as `<twin>-forced`), so realized
speedup compares like with like (same text, same tokens, with and without tags).

A method's `reference` is what it is measured against: None means the run's baseline. Methods are
named `name[:model_path]` (no path: the run's default model). Skeleton-of-Thought's two stages (sot, sot-router,
sot-forced) live in pasta_jax/baselines/methods.py; `commands/eval_registry.py` lists every method by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pasta_jax.data.encode import record_prompt
from pasta_jax.decode import api
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError, TagError
from pasta_jax.methods import Method as DecodingMethod
from pasta_jax.methods import Setup, generate, prepared, registry


class MethodError(PastaError):
  """An unknown method, a bad method spec, or prompts a method cannot run."""


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """What every method of one run shares (part of the run's identity for resume)."""

  max_new_tokens: int = 256
  lanes: int = 8
  chat: bool = True  # Gemma chat turns, as SFT trains (data.encode)
  dtype: str = "float32"
  repetition_penalty: float = 1.0  # greedy under CTRL's penalty (decode.sampling), for every method alike
  distinct_topics: bool = False  # PASTA's main may not reuse a promise topic (decode.sampling)
  head_dtype: str | None = None  # the output head in a narrower dtype (api.check_head_dtype), for every method
  certify_head: bool = False  # greedy choices certified against the float32 head (decode/certified_head.py)
  fork_bias: float = 0.0  # PASTA's promise-open logit offset (decode.sampling); bench.learned sets it per method
  max_topic_tokens: int = 0  # PASTA's cap on a promise topic (decode.sampling), 0: none; set per method as well

  @property
  def runtime(self) -> Runtime:
    return Runtime(dtype=self.dtype, head_dtype=self.head_dtype, certify_head=self.certify_head)

  def shared_options(self, method: DecodingMethod) -> DecodingMethod:
    """`method` with the run's lanes, where it has lanes."""
    has_lanes = any(f.name == "lanes" for f in method.options())
    return dataclasses.replace(method, lanes=self.lanes) if has_lanes else method

  def identity(self) -> dict:
    """What makes two runs comparable; a setting added later is left out at its default, so older runs resume."""
    added_later = {"distinct_topics": False, "head_dtype": None, "certify_head": False, "fork_bias": 0.0,
                   "max_topic_tokens": 0}
    # A certified head's narrow copy is part of its timing: name the one this machine compiles (int8 on a CPU,
    # where older runs compiled bfloat16), so a run decoded through another one starts afresh.
    narrow = api.narrow_head_dtype(self.head_dtype, self.certify_head)
    settings = {**vars(self), "head_dtype": narrow}
    return {k: v for k, v in settings.items() if not (k in added_later and v == added_later[k])}


@dataclasses.dataclass(frozen=True)
class MethodOutput:
  text: str  # the clean answer the judge sees
  annotated: str  # promise form (= text when untagged)
  steps: int  # interpreter steps
  seconds: float  # wall time of the timed (second) run, compile excluded
  theoretical_speedup: float  # own content tokens / critical path (nan if the answer is malformed)
  parallelism: float  # content tokens / critical path
  content_tokens: int  # tokens of the sequential answer: no tags, topics or end id
  critical_path: float  # decode steps with unlimited lanes (nan if malformed)
  finished: bool  # ended with an end id (not cut off by the step budget)
  threads: int = 1  # main + forks
  note: str = ""  # why a forced answer was replayed without tags, etc.
  head_fallbacks: int = 0  # steps a certified head chose again from the float32 head (`certify_head`)
  refusals: int = 0  # most likely tokens a limit refused (`Result.refused` says what: forks, topics cut at a cap)


class Method(Protocol):
  name: str  # the spec it was built from, e.g. "pasta:runs/sft/model"; unique within a run
  reference: Method | None  # what it is measured against; None: the run's baseline

  def check(self, records: Sequence[Mapping[str, str]]) -> None:
    """Raises MethodError if some record cannot be run (before any decoding starts)."""
    ...

  def run(self, record: Mapping[str, str]) -> MethodOutput:
    ...


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  name: str
  model_path: str | None = None

  @property
  def label(self) -> str:
    return self.name if self.model_path is None else f"{self.name}:{self.model_path}"


# --- the interpreter methods -------------------------------------------------------------------------
class InterpreterMethod:
  """Greedy, batch-1 decoding of a decoding method through the interpreter: free, or replaying `forced(record)`."""

  def __init__(self, name: str, model, settings: DecodeSettings, method: DecodingMethod,
               forced: ForcedAnswer | None = None, reference: Method | None = None):
    self.name, self.model, self.settings, self.forced, self.reference = name, model, settings, forced, reference
    setup = Setup(max_new_tokens=settings.max_new_tokens, runtime=settings.runtime)
    self.method = prepared(settings.shared_options(method), model, setup)  # once per model (heads, step times)

  def check(self, records: Sequence[Mapping[str, str]]) -> None:
    if self.forced is not None:
      self.forced.check(records, self.name)

  def run(self, record: Mapping[str, str]) -> MethodOutput:
    s = self.settings
    answer, note, budget = self.forced(record) if self.forced is not None else (None, "", s.max_new_tokens)
    sampling = SamplingConfig(repetition_penalty=s.repetition_penalty, distinct_topics=s.distinct_topics,
                              fork_bias=s.fork_bias, max_topic_tokens=s.max_topic_tokens)
    try:
      [result] = generate(self.model, [record_prompt(record)], self.method, max_new_tokens=budget, chat=s.chat,
                          sampling=sampling, forced_answers=None if answer is None else [answer], runtime=s.runtime)
    except TagError as err:
      raise MethodError(f"prompt {record['id']}: its {self.method.name} answer cannot be replayed: {err}") from None
    if result.drafts:
      note = f"best of {len(result.drafts)} drafts"
    if result.refusals:  # what the limits suppressed is reported with the answer
      note = "; ".join(filter(None, [note, f"{result.refusals} {result.refused}"]))
    return output_of(result, note)


def output_of(result: api.PastaResult, note: str = "") -> MethodOutput:
  """Every method's Result carries its own critical path (nan when the answer is cut off mid-block)."""
  return MethodOutput(text=result.text, annotated=result.annotated, steps=result.steps, seconds=result.seconds,
                      theoretical_speedup=result.theoretical_speedup, parallelism=result.theoretical_parallelism,
                      content_tokens=result.content_tokens, critical_path=result.critical_path,
                      finished=result.finished, threads=len(result.threads) or len(result.thread_texts), note=note,
                      head_fallbacks=result.head_fallbacks, refusals=result.refusals)


class ForcedAnswer:
  """The answer a forced method replays: the record's reference answer cut to the token budget, annotated in the
  method's form (`tagged=True`) or without tags (its twin's)."""

  def __init__(self, model, budget: int, tagged: bool, form: DecodingMethod):
    self.model, self.tokenizer = model, api.LangTokenizer(model.tokenizer)
    self.budget, self.tagged, self.form = budget, tagged, form

  def check(self, records: Sequence[Mapping[str, str]], method: str) -> None:
    missing = [r["id"] for r in records if not reference_answer(r)]
    if missing:
      raise MethodError(f"{method} replays reference answers, but {len(missing)} prompt(s) have none "
                        f"(first: id {missing[0]}); use prompts with answers (alpaca_eval_805, or a JSONL "
                        "with output/reference/annotated)")

  def __call__(self, record: Mapping[str, str]) -> tuple[str, str, int]:
    """(answer to replay, note, step budget). The budget fits the tagged answer, and is the same for both
    twins: equal pools and step budgets, so their per-step costs compare."""
    tagged, plain, note = self.answers(record)
    try:
      scripts = self.form.scripts([tagged], self.model)[0]
    except TagError as err:
      raise MethodError(f"prompt {record['id']}: its annotated answer cannot be replayed: {err}") from None
    budget = max(self.budget, sum(len(t) for t in scripts) + 2 * len(scripts))  # as decode.api.prepare sizes it
    return (tagged, note, budget) if self.tagged else (plain, "", budget)

  def answers(self, record: Mapping[str, str]) -> tuple[str, str, str]:
    """(tagged answer, its tag-free twin, note). Given annotations (the record's field of the method's form) are
    replayed whole; otherwise the reference answer is cut to the token budget and annotated by the method's
    annotator (the papers' structural rules)."""
    field = self.form.annotation_field
    if field and record.get(field):
      return record[field], self.form.tag_free(record[field]), ""
    plain = self.truncated(reference_answer(record))
    annotated, why = self.form.annotate_reference(plain, lambda text: len(self.tokenizer.encode(text)))
    if annotated is None:
      return plain, plain, f"{why}: replayed without tags"
    try:
      self.form.scripts([annotated], self.model)
    except TagError as err:
      return plain, plain, f"annotation rejected ({err}): replayed without tags"
    return annotated, plain, ""

  def truncated(self, answer: str) -> str:
    ids = self.tokenizer.encode(answer)
    return answer if len(ids) <= self.budget else self.tokenizer.decode(ids[: self.budget])


def reference_answer(record: Mapping[str, str]) -> str:
  return record.get("reference") or record.get("output") or ""


# --- the registry ------------------------------------------------------------------------------------
MethodFactory = Callable[[MethodSpec, object, DecodeSettings], Method]  # (spec, loaded model, settings)
FORCED = "-forced"  # the suffix of a method that replays annotated reference answers


def free_method(name: str) -> MethodFactory:
  """The decoding method `name` decoding freely."""
  return lambda spec, model, settings: InterpreterMethod(spec.label, model, settings, registry.resolve(name))


def forced_method(name: str) -> MethodFactory:
  """The decoding method `name` replaying its annotation of each reference answer, measured against the tag-free
  twin of that answer replayed by its `tag_free_twin` (`sequential-forced`, or `<name>-tag-free` when the twin
  is the method itself); a method with no twin (sequential) is itself the baseline."""
  def build(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
    method = registry.resolve(name)
    twin_method = method.tag_free_twin()
    tagged = ForcedAnswer(model, settings.max_new_tokens, tagged=True, form=method)
    if twin_method is None:
      return InterpreterMethod(spec.label, model, settings, method, tagged)
    label = f"{name}-tag-free" if type(twin_method) is type(method) else twin_method.name + FORCED
    twin = InterpreterMethod(MethodSpec(label, spec.model_path).label, model, settings, twin_method,
                             ForcedAnswer(model, settings.max_new_tokens, tagged=False, form=method))
    return InterpreterMethod(spec.label, model, settings, method, tagged, reference=twin)
  return build


def core_methods() -> dict[str, MethodFactory]:
  """The eval methods of the registry's decoding methods, as it stands (a method registered later is in too); the
  paper's SoT stages add theirs in baselines/methods.py."""
  out = {name: free_method(name) for name in registry.names(needs_scripts=False)}
  for name in registry.names(annotates=True):
    out[name + FORCED] = forced_method(name)
  return out


@functools.lru_cache(maxsize=4)
def cached_model(path: str | None):
  """Each model loaded once per process (a baseline and a method often share one)."""
  from pasta_jax.model.load import load_model
  return load_model(path)
