"""What a decoding method is: a frozen value of its options, with everything the layers above the core ask of it.

A method is declared once, in its own file in this package, as a frozen dataclass subclassing `Method`: its
options are the dataclass fields (checked in `check_options`, once), and its methods say

- which rule object, lanes and read-only inputs a run takes (`layout`);
- how a forced answer becomes per-thread scripts (`scripts`; `Capabilities.replay` says whether it replays);
- how a run's records become its `Result` (`build_result`);
- what it prepares once per model: Medusa heads, a calibrated step-time table, an n-gram index (`setup`,
  and `serving` for `pasta serve`, which has no calibration run and no prompt yet);
- what it can do (`capabilities`): stream, be served, replay, sample, run on a mesh, ...

`generate`, `stream`, the CLI, `pasta eval` and `pasta serve` ask the method; none of them knows a method by name.
The registry (`registry.py`) lists the methods; a new one is a new file here plus its line there.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from pasta_jax.decode.result import Result, pasta_result
from pasta_jax.decode.rules import Rules
from pasta_jax.decode.runtime import Runtime
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.errors import PastaError


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a method can do; the layers above the core read these instead of its name."""

  stream: bool = False  # its settled text grows as it decodes (`serve.streaming`); else it is handed out at the end
  serve: bool = True  # `pasta serve` runs it in a batch of rows
  replay: bool = False  # it replays forced answers (`forced_answers`, `scripts`)
  sample: bool = True  # it samples with temperature / top-p; False: a deterministic search of its own
  shard: bool = False  # tested equal to one device on a mesh (`runtime.mesh`); else refused there
  certify_head: bool = True  # its greedy choices are argmaxes a certified head can make
  promises: bool = False  # it decodes PASTA promises (a PASTA model's answer is whole only under such a method)
  distinct_topics: bool = False  # it keeps `SamplingConfig.distinct_topics` (a method with promises that does not
  # refuses it; one without ignores it)
  topic_cap: bool = False  # it keeps `SamplingConfig.max_topic_tokens` (any other method refuses a cap)
  threads: bool = False  # its answer is shown with a thread chart (`pasta generate`)
  drafts: bool = False  # its answer has several drafts (`Result.drafts`; a request's n takes the best n)
  learns_latency: bool = False  # served, it learns its step-time table from its own chunks (`serve/propd.py`)
  needs_scripts: bool = False  # it runs only on given per-thread scripts (SoT's point fan-out)
  annotates: bool = False  # it annotates reference answers in its form (`annotate_reference`: `pasta eval`'s
  # <name>-forced replays them)


@dataclasses.dataclass(frozen=True)
class Layout:
  """What the decode core runs for a method: its rule object, its lanes and its read-only inputs."""

  rules: Rules
  lanes: int
  max_threads: int
  rule_inputs: Any = None


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a method's one-time preparation may look at: sample prompt ids (ProPD times its steps on them; none: a
  prompt of its own), the answers' budget, and how the model runs."""

  ids: Sequence[Sequence[int]] = ()
  max_new_tokens: int = 256
  runtime: Runtime = Runtime()


def option_help(text: str, **extra) -> dict:
  """A field's metadata: its help line (the CLI's flag help) and, optionally, `parse` (flag text -> value) or
  `cli=False` (no flag: a Python-only option such as an explicit tree)."""
  return {"help": text, **extra}


@dataclasses.dataclass(frozen=True)
class Method(abc.ABC):
  """A decoding method's options (subclasses add fields) and its hooks. Subclasses are frozen dataclasses."""

  name: ClassVar[str] = "method"
  summary: ClassVar[str] = ""  # one line: what it does (the CLI's --method help, the README's table)
  capabilities: ClassVar[Capabilities] = Capabilities()
  # the tag vocabulary's position mode; unannotated so that PASTA can declare it as an option (a field)
  position_mode = "pred"

  def __post_init__(self):
    try:
      self.check_options()
    except ValueError as err:
      raise PastaError(f"method {self.name!r}: {err}") from None

  def check_options(self) -> None:  # noqa: B027 (a hook: a method without options checks nothing)
    """Raises ValueError for a bad option (said with the method's name)."""

  # --- what the core runs ------------------------------------------------------------------------------
  @abc.abstractmethod
  def layout(self, model, scripts) -> Layout:
    """The rule object, lanes and read-only inputs of a run (`scripts`: the forced scripts, or None)."""

  def scripts(self, answers: Sequence[str], model) -> list:
    """Forced answers (this method's text form) -> per-request, per-thread token scripts."""
    raise PastaError(f"method {self.name!r} replays no forced answers")

  def build_result(self, run, seconds: float, tokenizer, vocab, method: str) -> Result:
    """A run's records -> its Result (the promise form by default)."""
    return pasta_result(run, seconds, tokenizer, vocab, method)

  # --- reference answers in this method's form (`pasta eval`'s forced replays) ----------------------------
  annotation_field: ClassVar[str | None] = None  # a record's field that holds an answer already in this form

  def annotate_reference(self, answer: str, count_tokens) -> tuple[str | None, str]:
    """A tag-free answer annotated in this method's form by the papers' structural rules, or (None, why not)."""
    return None, f"method {self.name!r} has no annotator"

  def tag_free(self, annotated: str) -> str:
    """An answer of this method's form without its tags."""
    return annotated

  def tag_free_twin(self) -> Method | None:
    """The method that replays the tag-free twin of a forced answer (None: this one replays tag-free answers)."""
    return None

  # --- once per model ----------------------------------------------------------------------------------
  def setup(self, model, setup: Setup) -> Method:
    """This method with what it needs from `model` resolved (heads loaded, steps timed, index built): done once
    per model by every caller (`registry.prepared`), so a run of it does no preparation of its own."""
    return self

  def setup_key(self, setup: Setup) -> tuple:
    """What of `setup` this method's preparation depends on (its result is reused while this is the same)."""
    return ()

  def serving(self, model, setup: Setup) -> Method:
    """`setup` for `pasta serve`: no calibration run (a served ProPD learns its step times online)."""
    return self.setup(model, setup)

  # --- checks of a request against the method ---------------------------------------------------------------
  def check_request(self, *, sampling: SamplingConfig, runtime: Runtime, forced: bool) -> None:
    """Raises PastaError for shared settings this method cannot honour, naming both."""
    caps = self.capabilities
    if forced and not caps.replay:
      raise PastaError(f"method={self.name!r} decodes the model's own tokens: it replays no forced answers")
    if runtime.mesh is not None and not caps.shard:
      raise PastaError(f"method={self.name!r} is not tested on a mesh (its capabilities say so): decode it on one "
                       "device")
    if runtime.certify_head and not caps.certify_head:
      raise PastaError(f"certify_head certifies greedy argmax choices; method={self.name!r} reads probabilities "
                       "from the logits")
    if sampling.distinct_topics and caps.promises and not caps.distinct_topics:
      raise PastaError(f"distinct_topics is PASTA's flat-promise rule; method={self.name!r} does not implement it "
                       "(methods without promises ignore it)")
    if sampling.biases_forks and not caps.promises:
      raise PastaError(f"fork_bias={sampling.fork_bias:g} moves the logit of the token that opens a PASTA promise; "
                       f"method={self.name!r} opens no promises (give 0, or a method with promises such as pasta)")
    if sampling.caps_topics and not caps.topic_cap:
      raise PastaError(f"max_topic_tokens={sampling.max_topic_tokens} caps a PASTA promise's topic; "
                       f"method={self.name!r} does not write topics it can cap (give 0, or the pasta method)")
    if not sampling.greedy and not caps.sample:
      raise PastaError(f"method={self.name!r} searches deterministically: it takes no temperature, top-k or top-p")

  @property
  def max_choices(self) -> int:
    """The most choices one request may ask of it (OpenAI's `n`): its drafts, for a method that writes several."""
    return 1

  @classmethod
  def options(cls) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)

  def described(self) -> str:
    """The method with the options that differ from their defaults, e.g. "medusa(tree_size=8)"."""
    changed = [f"{f.name}={getattr(self, f.name)!r}" for f in self.options()
               if f.default is not dataclasses.MISSING and getattr(self, f.name) != f.default]
    return f"{self.name}({', '.join(changed)})" if changed else self.name


LANES = option_help("parallel lanes per request (lane 0 is main)")
MAX_THREADS = option_help("threads per request (main and every fork it spawns)", cli=False)


@dataclasses.dataclass(frozen=True)
class Threaded(Method, abc.ABC):
  """A method whose requests run several threads on a few lanes (PASTA, APAR, SoT, the scoped mode, trees)."""

  lanes: int = dataclasses.field(default=8, metadata=LANES)
  max_threads: int = dataclasses.field(default=64, metadata=MAX_THREADS)

  def check_options(self) -> None:
    if self.lanes < 1:
      raise ValueError(f"lanes must be at least 1, got {self.lanes}")
    if self.max_threads < 1:
      raise ValueError(f"max_threads must be at least 1, got {self.max_threads}")
