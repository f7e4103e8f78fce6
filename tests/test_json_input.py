"""Every JSON(L) file a user hands the CLI fails in one line naming file, line and problem, never a
traceback: bad JSON, a 5,000-digit integer (past Python's int-string limit: a plain ValueError), a
100,000-deep list (RecursionError), bytes that are not UTF-8, a lone surrogate escape; and the model
folder's JSON files alike."""

from __future__ import annotations

import json
import types

import pytest

from pasta_jax.cli import main
from pasta_jax.data import sources
from pasta_jax.errors import PastaError, WeightsError
from pasta_jax.eval import methods as M
from pasta_jax.model import checkpoint, load, lora, medusa, runfiles, weights

GOOD = json.dumps({"id": "1", "instruction": "Hi", "output": "Hello."}).encode() + b"\n"
DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_LINES = {  # line 2 of a file whose line 1 is GOOD (and line 3 blank): the error, as the CLI prints it
  "long_int": (b'{"id": ' + b"7" * 5000 + b', "instruction": "Hi", "output": "Hello."}',
               "a number with more digits than Python reads"),
  "deep_list": (DEEP, "JSON nested too deeply to read"),
  "deep_field": (b'{"id": "2", "instruction": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}",
                 "JSON nested too deeply to read"),
  "not_utf8": (b'{"id": "2", "instruction": "caf\xe9", "output": "x"}', "not UTF-8 text"),
  "surrogate": (b'{"id": "2", "instruction": "a \\ud800 b", "output": "x"}', "unpaired surrogate"),
  "bad_json": (b'{"id": "2", "instruction": ', "bad JSON"),
}
COMMANDS = {  # every command that reads instruction JSONL, stopped at the file (no model, no tokenizer)
  "eval": lambda data, out: ["eval", "--prompts", data, "--judge", "none", "--out", out],
  "annotate": lambda data, out: ["annotate", data, "--with", "apar", "--out", f"{out}.jsonl"],
  "data-stats": lambda data, out: ["data-stats", data, "--annotator", "none", "--out", out],
}


@pytest.fixture
def no_model_loads(monkeypatch):
  monkeypatch.setattr(M, "cached_model", lambda path: pytest.fail("loaded a model before reading the prompts"))


def write(tmp_path, line: bytes):
  path = tmp_path / "prompts.jsonl"
  path.write_bytes(GOOD + line + b"\n\n")
  return path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD_LINES)
def test_the_cli_names_file_and_line_in_one_line(tmp_path, capsys, no_model_loads, command, case):
  line, problem = BAD_LINES[case]
  path = write(tmp_path, line)
  assert main(COMMANDS[command](str(path), str(tmp_path / "out"))) == 2
  captured = capsys.readouterr()
  assert captured.err.startswith(f"pasta: error: {path}:2: ") and problem in captured.err
  assert captured.err.count("\n") == 1 and len(captured.err) < 300 and "Traceback" not in captured.out + captured.err


def test_parse_json_names_where_and_keeps_the_callers_error():
  for text in (b"7" * 5000, DEEP, b"[1,", b"\xff"):
    with pytest.raises(WeightsError, match=r"^f\.json:9: "):
      runfiles.parse_json(text, "f.json:9", WeightsError)
  assert runfiles.parse_json(b"7" * 4000, "x") == int("7" * 4000)  # under the limit: read as ever
  assert runfiles.parse_json(b"[" * 100 + b"]" * 100, "x") is not None


def test_iter_jsonl_skips_blank_lines_and_counts_them(tmp_path):
  path = tmp_path / "f.jsonl"
  path.write_bytes(b'{"a": 1}\n\n  \n[2]\r\n' + DEEP + b"\n")
  rows = runfiles.iter_jsonl(path)
  assert next(rows) == (1, {"a": 1}) and next(rows) == (4, [2])
  with pytest.raises(PastaError, match=f"^{path}:5: JSON nested too deeply"):
    next(rows)
  with pytest.raises(PastaError, match="cannot open data file"):
    next(runfiles.iter_jsonl(tmp_path / "missing.jsonl"))


def test_a_deep_id_is_named_without_recursing(tmp_path):
  """Nesting under the parser's limit reads, and the error that shows the value shows a bounded repr."""
  path = write(tmp_path, b'{"id": ' + b"[" * 900 + b"]" * 900 + b', "instruction": "Hi", "output": "x"}')
  with pytest.raises(sources.DataError, match=r":2: field 'id' must be .*\[\[\[") as err:
    sources.read_records(path)
  assert len(str(err.value)) < 300


@pytest.mark.parametrize("case", ["long_int", "deep_list"])
def test_model_folder_json_is_a_one_line_error(tmp_path, case):
  """generation.json, heads.json, pasta_config.json, adapter.json, config.json, the shard index."""
  text = BAD_LINES[case][0]
  for name in (load.GENERATION_FILE, medusa.CONFIG_FILE, checkpoint.META_FILE, lora.CONFIG_FILE, "config.json",
               weights.INDEX_FILE, medusa.WEIGHTS_FILE):
    (tmp_path / name).write_bytes(text)
  readers = [lambda: load.generation_defaults(types.SimpleNamespace(source=str(tmp_path))),
             lambda: medusa.load_heads(tmp_path), lambda: checkpoint.read_metadata(tmp_path),
             lambda: lora.load_adapter(tmp_path), lambda: weights.read_hf_config(tmp_path),
             lambda: weights.SafetensorsFolder(tmp_path)]
  for read in readers:
    with pytest.raises(PastaError) as err:
      read()
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)
