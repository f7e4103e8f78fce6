"""The one list of decoding methods, and what every caller asks of it: a method by name, the names that can do
something, and a method prepared once per model.

A new method is one file in this package (a `Method` subclass) and its line in `METHODS` below; `register` adds
one from elsewhere (a plug-in, a test) the same way.
"""

from __future__ import annotations

import collections
import dataclasses

from pasta_jax.errors import PastaError
from pasta_jax.methods.apar import Apar
from pasta_jax.methods.base import Method, Setup
from pasta_jax.methods.medusa import Medusa, Propd
from pasta_jax.methods.pasta import Pasta
from pasta_jax.methods.pasta_trees import PastaTrees
from pasta_jax.methods.scoped import Scoped
from pasta_jax.methods.sequential import Sequential
from pasta_jax.methods.sot import Sot
from pasta_jax.methods.superposed import Superposed

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
  """Adds a method class under its `name` (usable as a class decorator)."""
  if not (isinstance(cls, type) and issubclass(cls, Method) and dataclasses.is_dataclass(cls)):
    raise TypeError(f"a method is a frozen dataclass subclassing Method, got {cls!r}")
  known = METHODS.get(cls.name)
  if known is not None and known is not cls:
    raise ValueError(f"method name {cls.name!r} is taken by {known.__qualname__}")
  METHODS[cls.name] = cls
  return cls


for _cls in (Pasta, Sequential, Scoped, Apar, Sot, Superposed, Medusa, Propd, PastaTrees):
  register(_cls)


def names(**capabilities: bool) -> tuple[str, ...]:
  """The methods' names, in registry order; with capabilities given (e.g. `serve=True`), those that match."""
  return tuple(name for name, cls in METHODS.items()
               if all(getattr(cls.capabilities, cap) == want for cap, want in capabilities.items()))


def resolve(method: str | Method) -> Method:
  """A method value: a name gives its default options; a value is returned as it is."""
  if isinstance(method, Method):
    return method
  if not isinstance(method, str):
    raise PastaError(f"method must be a method name or a Method value, got {method!r}")
  cls = METHODS.get(method)
  if cls is None:
    raise PastaError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
  return cls()


class _Prepared:
  """Methods prepared per (model, method, setup), newest kept: a preparation can take seconds (ProPD times its
  steps), and a model is held here only while its entry is (ids of dropped models are never reused meanwhile)."""

  def __init__(self, maxsize: int = 8):
    self.maxsize, self.entries = maxsize, collections.OrderedDict()

  def get(self, method: Method, model, setup: Setup, serving: bool) -> Method:
    key = (id(model), method, method.setup_key(setup), serving)
    try:
      hit = self.entries.get(key)
    except TypeError:  # an option that is not hashable (an in-memory n-gram index): prepared afresh each time
      return method.serving(model, setup) if serving else method.setup(model, setup)
    if hit is not None and hit[0] is model:
      self.entries.move_to_end(key)
      return hit[1]
    ready = method.serving(model, setup) if serving else method.setup(model, setup)
    self.entries[key] = (model, ready)
    while len(self.entries) > self.maxsize:
      self.entries.popitem(last=False)
    return ready

  def clear(self) -> None:
    self.entries.clear()


PREPARED = _Prepared()
NO_SETUP = Setup()  # frozen: safe as a default argument


def prepared(method: str | Method, model, setup: Setup = NO_SETUP, *, serving: bool = False) -> Method:
  """`method` ready to run on `model`: its one-time preparation (`Method.setup`, or `Method.serving` for the
  server) done once per model, method and setup, for every caller alike."""
  return PREPARED.get(resolve(method), model, setup, serving)
