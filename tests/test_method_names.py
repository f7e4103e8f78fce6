"""One place knows each decoding method: outside `pasta_jax/methods/` no code compares a method's name as a string
(`method == "propd"`, `name in ("sot", ...)`) or lists method names (a tuple, list, set or dict of two or more):
it asks the registry and the method's capabilities instead (docs/interpreter.md, "Adding a method")."""

from __future__ import annotations

import ast
from pathlib import Path

from pasta_jax.methods import registry

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "pasta_jax" / "methods"


def name_constants(nodes, names) -> list[str]:
  return [n.value for n in nodes if isinstance(n, ast.Constant) and n.value in names]


def offences(source: str, names) -> list[tuple[int, str]]:
  """(line, what) for each comparison with a method name and each literal collection of two or more names."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      operands = []
      for side in (node.left, *node.comparators):
        operands += side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
      if name_constants(operands, names):
        found.append((node.lineno, "compares a method name"))
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(name_constants(node.elts, names)) >= 2:
      found.append((node.lineno, "lists method names"))
    elif isinstance(node, ast.Dict) and len(name_constants(node.keys, names)) >= 2:
      found.append((node.lineno, "lists method names"))
  return found


def test_the_scan_finds_what_it_looks_for():
  names = set(registry.METHODS)
  assert offences('if method == "propd": pass', names) == [(1, "compares a method name")]
  assert offences('ok = name not in ("sot", "x")', names) == [(1, "compares a method name")]
  assert offences('TREES = ("medusa", "propd")', names) == [(1, "lists method names")]
  assert offences('f(method="pasta"); label = "sequential:" + path', names) == []


def test_no_method_name_is_compared_or_listed_outside_the_registry():
  names = set(registry.METHODS)
  bad = []
  for folder in ("pasta_jax", "train", "infer", "bench"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if REGISTRY in path.parents:
        continue
      bad += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in offences(path.read_text(), names)]
  assert bad == []
