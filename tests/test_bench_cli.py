"""Every bench the README shows parses its flags, prints its help, and finds its default data.

A bench that crashes before measuring (a default dataset name opened as a file path, a flag typo) is a
README command that does not run as written; this catches it without loading a model.
"""

import importlib
import re
from pathlib import Path

import pytest

from pasta_jax.data import sources

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "common", "replay"))
DATA_FLAGS = ("data", "prompts")


def test_every_bench_the_readme_names_exists():
  named = set(re.findall(r"python -m bench\.(\w+)", (ROOT / "README.md").read_text()))
  assert named, "the README names no bench"
  assert named <= set(BENCHES), f"README names missing benches: {sorted(named - set(BENCHES))}"


@pytest.mark.parametrize("name", BENCHES)
def test_help_exits_cleanly(name, capsys):
  module = importlib.import_module(f"bench.{name}")
  with pytest.raises(SystemExit) as exit_info:
    module.parse_args(["--help"])
  assert exit_info.value.code == 0
  assert "usage: bench." + name in capsys.readouterr().out


@pytest.mark.parametrize("name", BENCHES)
def test_default_data_loads(name):
  args = importlib.import_module(f"bench.{name}").parse_args([])
  for flag in DATA_FLAGS:
    if hasattr(args, flag):  # the very call the bench's main makes to read it
      assert sources.read_records(getattr(args, flag), 2), f"bench.{name} --{flag} default gives no records"


@pytest.mark.parametrize("name, argv, usage", [
    ("generate", ["a prompt", "--help"], "usage: pasta generate"),  # one prompt: `pasta generate`
    ("generate", ["--help"], "usage: infer.generate"),  # a file of prompts: its own command
    ("eval", ["--help"], "usage: pasta eval"), ("serve", ["--help"], "usage: pasta serve")])
def test_infer_entry_points(name, argv, usage, capsys):
  module = importlib.import_module(f"infer.{name}")
  with pytest.raises(SystemExit) as exit_info:
    module.main(argv)
  assert exit_info.value.code == 0
  assert usage in capsys.readouterr().out
