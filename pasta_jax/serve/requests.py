"""What travels between the HTTP side and the engine: a `Request` in, `Update`s out, and the two refusals."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from pasta_jax.decode.result import Result
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.thread_text import ThreadText
from pasta_jax.errors import PastaError
from pasta_jax.methods import Method


@dataclasses.dataclass(frozen=True)
class Update:
  """What a request learns after a chunk: new settled text, and at the end the result."""

  delta: str
  done: bool = False
  finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
  result: Result | None = None
  note: str = ""
  # finish_reason "error": the HTTP status it is answered with (400: the request cannot be served here; 500: the
  # server failed while running it; 504: its deadline passed)
  status: int = 500
  threads: tuple[ThreadText, ...] | None = None  # each thread's text so far, for a request with `thread_progress`


class QueueFull(PastaError):
  pass


class ShuttingDown(PastaError):
  pass


_IDS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
  """One completion: prompt ids, method, sampling and budgets, and where its updates go."""

  ids: list[int]
  method: Method  # (a name, when submitted: the engine's served method of that name)
  max_tokens: int
  sink: Callable[[Update], None]
  sampling: SamplingConfig = SamplingConfig()  # this request's own: a batch row samples by it
  created: float = dataclasses.field(default_factory=time.perf_counter)
  queued_at: float | None = None  # when the engine queued it (`Engine.submit`)
  id: str = dataclasses.field(default_factory=lambda: f"cmpl-{next(_IDS)}")
  cancelled: bool = False  # set by the client side; the engine drops the request at its next visit
  sent: str = ""  # settled text already handed out
  counted: int = 0  # content tokens already counted in the metrics
  first_token_at: float | None = None
  question: str | None = None  # sot: the question its stages are built from
  chat: bool = True  # sot: whether its stage prompts are chat turns
  stage_of: Request | None = None  # an internal stage (`serve/stages.py`): the client request it serves
  hidden: bool = False  # a stage whose text the client never sees (SoT's skeleton); its normal end is not counted
  scripts: list | None = None  # a stage's per-thread point prompts
  render: Callable | None = None  # a stage's text from (records, final), instead of the method's
  thread_progress: bool = False  # an update after every chunk, with each thread's text (`Update.threads`)

  @property
  def dropped(self) -> bool:
    return self.cancelled or (self.stage_of is not None and self.stage_of.cancelled)

  @property
  def label(self) -> str:
    """The method the metrics count it under: the client's."""
    return (self.stage_of or self).method.name
