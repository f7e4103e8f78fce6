"""The shipped adapters and the tuned default model (`load_model()`, `pasta generate`)."""

from __future__ import annotations

import json

import pytest

from pasta_jax.errors import WeightsError
from pasta_jax.methods import Medusa, Pasta, PastaTrees
from pasta_jax.model import load as load_lib
from pasta_jax.model.lora import CONFIG_FILE, WEIGHTS_FILE
from tests.marks import HEAVY

MAX_BYTES = 16 * 2**20  # the size budget per shipped adapter


def _fake_shipped(root, names):
  for name in names:
    (root / name).mkdir(parents=True)
    (root / name / CONFIG_FILE).write_text(json.dumps({"base": "embedded"}))


@pytest.mark.parametrize("names, default", [
    (["pasta-sft", "baseline-sft"], "pasta-sft"),
    (["pasta-bon", "pasta-sft", "baseline-sft"], "pasta-bon"),
    (["baseline-sft"], None),  # Baseline-SFT is never the PASTA default
    ([], None),
])
def test_the_default_is_the_best_shipped_pasta_adapter(tmp_path, monkeypatch, names, default):
  monkeypatch.setattr(load_lib, "SHIPPED_DIR", tmp_path)
  _fake_shipped(tmp_path, names)
  got = load_lib.default_model_path()
  assert (got.name if got else None) == default


def test_an_adapter_that_is_not_shipped_is_named(tmp_path, monkeypatch):
  monkeypatch.setattr(load_lib, "SHIPPED_DIR", tmp_path)
  _fake_shipped(tmp_path, ["pasta-sft"])
  with pytest.raises(WeightsError, match="ships no 'pasta-bon' adapter.*pasta-sft"):
    load_lib.load_model("pasta-bon")


def test_shipped_adapters_fit_the_budget_and_name_the_embedded_base():
  names = load_lib.shipped_names()
  assert "pasta-sft" in names and "baseline-sft" in names
  for name in names:
    folder = load_lib.shipped_adapter(name)
    assert (folder / WEIGHTS_FILE).stat().st_size <= MAX_BYTES, name
    assert json.loads((folder / CONFIG_FILE).read_text())["base"] == "embedded"


def test_every_shipped_file_is_package_data():
  """A wheel carries only what pyproject's package-data names: a shipped file it misses (generation.json was) would
  be silently lost outside an editable install."""
  import fnmatch
  from pathlib import Path

  import tomllib

  package = Path(load_lib.__file__).parents[1]
  pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
  patterns = pyproject["tool"]["setuptools"]["package-data"]["pasta_jax"]
  files = [p.relative_to(package).as_posix() for p in load_lib.SHIPPED_DIR.rglob("*") if p.is_file()]
  assert any(f.endswith("generation.json") for f in files)
  for file in files:
    assert any(fnmatch.fnmatch(file, pattern) for pattern in patterns), file


@pytest.mark.slow
def test_the_tuned_default_loads_folded_and_forks_on_a_list_prompt():
  import pasta_jax
  model = pasta_jax.load_model()
  assert model.adapter is not None and "adapter" in model.describe()
  assert pasta_jax.load_model("base").adapter is None
  # 4 lanes, not 8: three lane buckets of the 18-layer model to trace and compile, not four
  [result] = pasta_jax.generate(model, ["Give three tips for staying healthy."], Pasta(lanes=4), max_new_tokens=128)
  assert len(result.threads) > 1, result.annotated  # it writes its own tags and they fork


def test_shipped_medusa_heads_fit_the_budget_and_name_their_model():
  from pasta_jax.decode.speculation import MEDUSA_DIR
  from pasta_jax.model import medusa
  folder = load_lib.shipped_adapter("pasta-sft") / MEDUSA_DIR
  assert (folder / medusa.WEIGHTS_FILE).stat().st_size <= MAX_BYTES
  heads, config, meta = medusa.load_heads(folder)
  assert config.shared_head and meta["base"].endswith("pasta-sft")


@pytest.mark.slow
@HEAVY  # tests/test_medusa.py holds the rule (trees write plain greedy's tokens) on tiny models
def test_the_tuned_default_decodes_with_its_medusa_heads_as_plain_greedy():
  import pasta_jax
  model = pasta_jax.load_model()
  prompts = ["Give three tips for staying healthy.", "What is the capital of France?"]
  plain = pasta_jax.generate(model, prompts, "sequential", max_new_tokens=24)
  tree = pasta_jax.generate(model, prompts, Medusa(tree_size=4), max_new_tokens=24)
  for p, t in zip(plain, tree):
    assert t.records[:, 3].tolist() == p.records[:, 3].tolist()
    assert t.speculation["accept_length"] > 1.0  # the shipped heads guess some tokens right


@pytest.mark.slow
@HEAVY  # about a minute of compiles; tests/test_pasta_trees.py holds the rule on toy and tiny models
def test_the_tuned_default_with_a_tree_on_every_thread_writes_its_pasta_answer():
  import pasta_jax
  model = pasta_jax.load_model()
  prompt = ["Give three tips for staying healthy."]
  # a budget the answer finishes within: where the budget cuts it, threads that ran ahead in trees stop elsewhere
  [pasta] = pasta_jax.generate(model, prompt, Pasta(lanes=2), max_new_tokens=96)
  [trees] = pasta_jax.generate(model, prompt, PastaTrees(tree_size=4, lanes=2), max_new_tokens=96)
  assert pasta.finished and len(pasta.threads) > 1  # it forks
  assert trees.annotated == pasta.annotated  # and the trees change nothing
  assert trees.steps < pasta.steps
