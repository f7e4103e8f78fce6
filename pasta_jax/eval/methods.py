"""Decoding methods that `pasta eval` compares, as a small registry.

A method turns one prompt record into a `MethodOutput`. Every method here decodes through the one
PASTA interpreter (`decode.api.generate`), greedy, batch 1, as the paper times both sides ("baseline
model time divided by test model time, both using the PASTA-LANG interpreter"): the baseline is then
measured on the same machinery, so realized speedup measures parallel decoding, not the interpreter's
overhead over plain decoding (about 7% on CPU, `bench.interpreter`).

  sequential         the baseline: the model decodes freely; an untagged answer runs on one lane
  pasta              the model decodes freely and its tags fork threads (a Pasta-SFT/BoN model)
  pasta-forced       replays the structural annotation of the record's reference answer, truncated
                     to --max-new-tokens; measured against its twin below, so realized speedup
                     compares like with like (same text, same tokens, with and without tags)
  sequential-forced  that twin: the same truncated answer without tags, replayed sequentially
  superposed         Superposed Decoding (paper 002): 3 drafts from one decode, n-gram smoothed; the
                     answer is the most probable draft
  pasta-v0           the earlier paper's scoped mode: the model decodes freely, its `<scope>` and
                     `<promise/>` tags fork threads (a model trained with `train.sft --objective scoped_sft`)
  medusa             Medusa (paper 004's drafter): greedy token-tree speculation with the model's shipped Medusa
                     heads, a 16-node tree; lossless, so the answer is the sequential one, faster or not
  propd              ProPD: the same with its dynamic tree size (up to 64 nodes), latency calibrated at start
  pasta+medusa       PASTA x trees: the model's forks run as threads and every live thread speculates with a
                     4-node Medusa tree in the same step; lossless, so the answer is the pasta one
  pasta-v0-forced    replays the earlier paper's structural annotation (lists are scopes, item elaborations
                     async blocks) of the reference answer, truncated to --max-new-tokens, against its
                     tag-free twin replayed through the same scoped interpreter (`sequential-forced-v0`)

A method's `reference` is what it is measured against: None means the run's baseline. Methods are
named `name[:model_path]` (no path: the run's default model). The baselines (apar, apar-forced, sot,
sot-router) live in pasta_jax/baselines/methods.py; `commands/eval_registry.py` lists every method by name.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import jax.numpy as jnp

from pasta_jax.data.encode import record_prompt
from pasta_jax.data.structural import annotate
from pasta_jax.data.structural_scoped import annotate_scoped
from pasta_jax.decode import api
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError, TagError
from pasta_jax.lang import scoped
from pasta_jax.lang.text import strip_tags


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

  def identity(self) -> dict:
    """What makes two runs comparable; a setting added later is left out at its default, so older runs resume."""
    added_later = {"distinct_topics": False, "head_dtype": None, "certify_head": False}
    # A certified head's narrow copy is part of its timing: name the one this machine compiles (int8 on a CPU
    # since session 30), so a run decoded through another one starts afresh.
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
  """Greedy, batch-1 decoding through the interpreter: free, or replaying `forced(record)`."""

  def __init__(self, name: str, model, settings: DecodeSettings, forced: ForcedAnswer | None = None,
               reference: Method | None = None, method: str = "pasta", **method_options):
    self.name, self.model, self.settings, self.forced, self.reference = name, model, settings, forced, reference
    self.method, self.method_options = method, method_options

  def check(self, records: Sequence[Mapping[str, str]]) -> None:
    if self.forced is not None:
      self.forced.check(records, self.name)

  def run(self, record: Mapping[str, str]) -> MethodOutput:
    s = self.settings
    answer, note, budget = self.forced(record) if self.forced is not None else (None, "", s.max_new_tokens)
    sampling = SamplingConfig(repetition_penalty=s.repetition_penalty, distinct_topics=s.distinct_topics)
    [result] = api.generate(self.model, [record_prompt(record)], method=self.method, max_new_tokens=budget,
                            lanes=s.lanes, chat=s.chat, dtype=jnp.dtype(s.dtype), sampling=sampling,
                            head_dtype=s.head_dtype, certify_head=s.certify_head,
                            forced_answers=None if answer is None else [answer],
                            **self.method_options)
    if result.drafts:
      note = f"best of {len(result.drafts)} drafts"
    return output_of(result, note)


def output_of(result: api.PastaResult, note: str = "") -> MethodOutput:
  """Every method's Result carries its own critical path (nan when the answer is cut off mid-block)."""
  return MethodOutput(text=result.text, annotated=result.annotated, steps=result.steps, seconds=result.seconds,
                      theoretical_speedup=result.theoretical_speedup, parallelism=result.theoretical_parallelism,
                      content_tokens=result.content_tokens, critical_path=result.critical_path,
                      finished=result.finished, threads=len(result.threads), note=note,
                      head_fallbacks=result.head_fallbacks)


class ForcedAnswer:
  """The answer a forced method replays: the record's reference answer cut to the token budget, with
  the structural annotation (`tagged=True`) or without tags (its sequential twin)."""

  def __init__(self, model, budget: int, tagged: bool, scoped_form: bool = False):
    self.tokenizer = api.LangTokenizer(model.tokenizer)
    self.vocab = model.tokenizer.tag_vocab()
    self.budget, self.tagged, self.scoped_form = budget, tagged, scoped_form

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
      scripts = self.scripts(tagged)
    except TagError as err:
      raise MethodError(f"prompt {record['id']}: its annotated answer cannot be replayed: {err}") from None
    budget = max(self.budget, sum(len(t) for t in scripts) + 2 * len(scripts))  # as decode.api.prepare sizes it
    return (tagged, note, budget) if self.tagged else (plain, "", budget)

  def scripts(self, answer: str) -> list[list[int]]:
    if self.scoped_form:
      return api.scoped_scripts(answer, self.tokenizer, self.vocab, lanes=64, max_threads=64, max_depth=3)
    return api.forced_scripts(answer, self.tokenizer, self.vocab)

  def answers(self, record: Mapping[str, str]) -> tuple[str, str, str]:
    """(tagged answer, its tag-free twin, note). Given annotations are replayed whole; otherwise the
    reference answer is cut to the token budget and annotated structurally (the scoped form: the earlier
    paper's rule, `data.structural_scoped`)."""
    field, strip = ("scoped", scoped.compose_text) if self.scoped_form else ("annotated", strip_tags)
    if record.get(field):
      return record[field], strip(record[field]), ""
    plain = self.truncated(reference_answer(record))
    annotator = annotate_scoped if self.scoped_form else annotate
    annotated = annotator(plain, lambda text: len(self.tokenizer.encode(text)))
    if annotated is None:
      return plain, plain, "no list structure: replayed without tags"
    try:
      self.scripts(annotated)
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


def _sequential(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  return InterpreterMethod(spec.label, model, settings)


def _pasta(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  return InterpreterMethod(spec.label, model, settings)  # the same loop: the model's own tags fork


def _superposed(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  from pasta_jax.data.ngram_corpus import ensure_default_index
  index = ensure_default_index(model.tokenizer, model.describe())  # built once, from the training pools
  return InterpreterMethod(spec.label, model, settings, method="superposed", drafts=3, ngram=str(index))


def _sequential_forced(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  return InterpreterMethod(spec.label, model, settings, ForcedAnswer(model, settings.max_new_tokens, tagged=False))


def _pasta_v0(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  return InterpreterMethod(spec.label, model, settings, method="pasta-v0")


def _pasta_v0_forced(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  twin = InterpreterMethod(MethodSpec("sequential-forced-v0", spec.model_path).label, model, settings,
                           ForcedAnswer(model, settings.max_new_tokens, tagged=False, scoped_form=True),
                           method="pasta-v0")
  return InterpreterMethod(spec.label, model, settings,
                           ForcedAnswer(model, settings.max_new_tokens, tagged=True, scoped_form=True),
                           reference=twin, method="pasta-v0")


def _pasta_forced(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  twin = _sequential_forced(MethodSpec("sequential-forced", spec.model_path), model, settings)
  return InterpreterMethod(spec.label, model, settings, ForcedAnswer(model, settings.max_new_tokens, tagged=True),
                           reference=twin)


def _medusa(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  from pasta_jax.decode.speculation import load_drafter
  return InterpreterMethod(spec.label, model, settings, method="medusa", heads=load_drafter(model))


def _pasta_medusa(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  from pasta_jax.decode.speculation import load_drafter
  return InterpreterMethod(spec.label, model, settings, method="pasta+medusa", heads=load_drafter(model))


def _propd(spec: MethodSpec, model, settings: DecodeSettings) -> Method:
  """ProPD with its latency model calibrated once, here, at batch 1 (the eval's batch size)."""
  from pasta_jax.decode.latency import calibrate_latency
  from pasta_jax.decode.speculation import DEFAULT_TREE, load_drafter
  drafter = load_drafter(model)
  ids = api.prompt_ids(model.tokenizer, ["Give three tips for staying healthy."], settings.chat)
  cal = calibrate_latency(model, ids, drafter, tree_size=DEFAULT_TREE, steps=16, run_tokens=settings.max_new_tokens,
                          dtype=jnp.dtype(settings.dtype))
  return InterpreterMethod(spec.label, model, settings, method="propd", heads=drafter, tree_size=cal["tree_size"],
                           latency=cal["table"])


CORE_METHODS: dict[str, MethodFactory] = {
  "sequential": _sequential,
  "pasta": _pasta,
  "pasta-forced": _pasta_forced,
  "superposed": _superposed,
  "sequential-forced": _sequential_forced,
  "pasta-v0": _pasta_v0,
  "pasta-v0-forced": _pasta_v0_forced,
  "medusa": _medusa,
  "propd": _propd,
  "pasta+medusa": _pasta_medusa,
}  # the paper's baselines add theirs in baselines/methods.py; commands/eval_registry.py holds them all


@functools.lru_cache(maxsize=4)
def cached_model(path: str | None):
  """Each model loaded once per process (a baseline and a method often share one)."""
  from pasta_jax.model.load import load_model
  return load_model(path)
