"""Layers run one way: lang -> model -> decode -> the rest -> commands (DESIGN).

Every import in the package (function-level ones included) is read with `ast`; a module that imports
from a higher layer fails the test, naming both. Python-level import circles fail it too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A module's layer is that of the longest prefix listed here.
LAYERS = (
    ("pasta_jax.errors", "pasta_jax.paths", "pasta_jax.visibility", "pasta_jax.endpoint"),
    ("pasta_jax.lang",),
    ("pasta_jax.model",),
    ("pasta_jax.decode",),
    ("pasta_jax.data", "pasta_jax.training", "pasta_jax.judges", "pasta_jax.preference", "pasta_jax.baselines",
     "pasta_jax.eval", "pasta_jax.methods"),
    ("pasta_jax.commands", "pasta_jax.cli", "pasta_jax"),
    ("train", "infer", "bench"),
)


def layer_of(module: str) -> int:
  best, rank = -1, None
  for i, prefixes in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
        best, rank = len(prefix), i
  if rank is None:
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")
  return rank


def module_name(path: Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
  """Modules of this project that `path` imports, anywhere in the file."""
  package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      # `from pkg import mod` imports the module; `from pkg import name` imports pkg (its __init__)
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
  return {m for m in found if m in MODULES}


SOURCES = sorted(p for folder in ("pasta_jax", "train", "infer", "bench") for p in (ROOT / folder).rglob("*.py")
                 if (ROOT / folder).is_dir())


MODULES = {module_name(p) for p in SOURCES}


def upward_imports(sources) -> list[str]:
  bad = []
  for path in sources:
    me = module_name(path)
    for other in project_imports(path):
      if layer_of(other) > layer_of(me):
        bad.append(f"{me} (layer {layer_of(me)}) imports {other} (layer {layer_of(other)})")
  return sorted(bad)


def test_no_lower_layer_imports_a_higher_one():
  assert upward_imports(SOURCES) == []


def test_no_import_circles():
  graph = {module_name(p): project_imports(p) - {module_name(p)} for p in SOURCES}
  state: dict[str, str] = {}  # "open" while on the depth-first path, then "done"
  circles = []

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  assert circles == []


def test_the_check_catches_an_upward_import(tmp_path):
  """The check can fail: a model module importing the decoder is reported."""
  fake = ROOT / "pasta_jax" / "model" / "gemma.py"
  planted = tmp_path / "gemma.py"
  planted.write_text(fake.read_text() + "\nfrom pasta_jax.decode import api\n")
  original = module_name
  try:
    globals()["module_name"] = lambda p: "pasta_jax.model.gemma" if p == planted else original(p)
    assert upward_imports([planted]) == ["pasta_jax.model.gemma (layer 2) imports pasta_jax.decode.api (layer 3)"]
  finally:
    globals()["module_name"] = original


if __name__ == "__main__":
  pytest.main([__file__])
