"""Every `pasta eval` method by name: the core ones (eval/methods.py) and the paper's baselines
(baselines/methods.py), listed here, explicitly, rather than registered as an import side effect. It lives with
the command, above both: the baselines build on eval's method interface, so eval cannot list them."""

from __future__ import annotations

from collections.abc import Callable

from pasta_jax.baselines.methods import BASELINE_METHODS
from pasta_jax.eval.methods import DecodeSettings, Method, MethodError, MethodFactory, MethodSpec, core_methods


def eval_methods() -> dict[str, MethodFactory]:
  """Every eval method by name: the registry's decoding methods (free, and forced where they annotate) and SoT's."""
  return {**core_methods(), **BASELINE_METHODS}


def parse_spec(text: str) -> MethodSpec:
  """'name' or 'name:model_path' -> MethodSpec; unknown names raise MethodError listing the known ones."""
  name, colon, path = text.strip().partition(":")
  methods = eval_methods()
  if name not in methods:
    known = ", ".join(methods)
    raise MethodError(f"unknown method {name!r}; known methods: {known} (write name or name:model_path)")
  if colon and not path:
    raise MethodError(f"method spec {text!r} has an empty model path after ':'")
  return MethodSpec(name, path or None)


def build_method(spec: MethodSpec, settings: DecodeSettings, load: Callable[[str | None], object],
                 default_model: str | None = None) -> Method:
  """The method for `spec`; `load(path)` gives a loaded model (None: the embedded one)."""
  return eval_methods()[spec.name](spec, load(spec.model_path or default_model), settings)
