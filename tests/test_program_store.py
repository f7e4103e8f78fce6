"""Compiled decode loops kept on disk (decode/program_store.py): a second process runs the loop the first compiled,
and what it decodes does not change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pasta_jax.decode import api, program_store
from pasta_jax.decode.program_store import ProgramStore
from pasta_jax.methods import Pasta, Sequential, generate_ids, prepare_run
from pasta_jax.model import user_cache
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[2, 5, 7, 9], [2, 40, 41]]

# One process: decode with the store in sys.argv[1]; print the tokens, the store's counts and which programs XLA
# compiled (jax's own compile log, independent of the store's counts).
PROCESS = """
import json, logging, sys
import jax
records = []
class Collect(logging.Handler):
  def emit(self, record):
    records.append(record.getMessage())
logging.getLogger("jax").addHandler(Collect())
jax.config.update("jax_log_compiles", True)
from pasta_jax.decode import api
from pasta_jax.methods import Pasta, Sequential, generate_ids
from tests.tiny import tiny_model
model = tiny_model()
tokens = [[int(t) for t in r.records[:, 3]] for method in (Sequential(), Pasta())
          for r in generate_ids(model, [[2, 5, 7, 9], [2, 40, 41]], method, max_new_tokens=12)]
loops = [m for m in records if "Compiling" in m and "prefill_and_run" in m]
print(json.dumps({"tokens": tokens, "compiles": api.COMPILED.compiles, "hits": api.COMPILED.store.hits,
                  "loop_compiles": len(loops)}))
"""


def run_process(folder: Path) -> dict:
  env = {**os.environ, user_cache.ENV: str(folder)}
  done = subprocess.run([sys.executable, "-c", PROCESS], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_no_decode_loop(tmp_path):
  first, second = run_process(tmp_path), run_process(tmp_path)
  assert first["compiles"] == 2 and first["hits"] == 0 and first["loop_compiles"] == 2  # sequential, PASTA
  assert second["compiles"] == 0 and second["hits"] == 2 and second["loop_compiles"] == 0
  assert second["tokens"] == first["tokens"]
  assert len(list((tmp_path / "programs").glob("*.program"))) == 2


@pytest.fixture
def store(tmp_path) -> ProgramStore:
  return ProgramStore(tmp_path)


def tokens(cache: api.CompileCache, model, method) -> list[list[int]]:
  prep = prepare_run(model, PROMPTS, method, max_new_tokens=10)
  executable = cache.get(prep, api.loop.prefill_and_run)
  out = executable(*api.dynamic_args(prep))
  return [[int(t) for t in r.records[:, 3]] for r in api.loop.unpack(out, prep.cfg)]


def test_a_stored_loop_decodes_what_a_compiled_one_does(store):
  model = tiny_model()
  compiled = tokens(api.CompileCache(store=store), model, Pasta())
  again = api.CompileCache(store=store)
  assert tokens(again, model, Pasta()) == compiled
  assert (again.compiles, store.hits, store.saves) == (0, 1, 1)
  expected = [[int(t) for t in r.records[:, 3]] for r in generate_ids(model, PROMPTS, Pasta(), max_new_tokens=10)]
  assert compiled == expected


def test_a_torn_or_foreign_file_is_compiled_again(store):
  model = tiny_model()
  first = tokens(api.CompileCache(store=store), model, Sequential())
  [path] = store.folder.glob(f"*{program_store.SUFFIX}")
  path.write_bytes(path.read_bytes()[:1000])  # torn
  again = api.CompileCache(store=store)
  assert tokens(again, model, Sequential()) == first
  assert again.compiles == 1 and store.failures == 1 and store.saves == 2


def test_changed_source_is_another_program(store, monkeypatch):
  model = tiny_model()
  tokens(api.CompileCache(store=store), model, Sequential())
  monkeypatch.setattr(program_store, "source_fingerprint", lambda: "a changed step")
  again = api.CompileCache(store=store)
  tokens(again, model, Sequential())
  assert again.compiles == 1 and store.hits == 0


def test_a_description_without_a_stable_form_is_refused():
  with pytest.raises(ValueError, match="no stable form"):
    program_store.digest((object(),))


def test_off_means_no_folder(monkeypatch, tmp_path):
  from pasta_jax import cli
  assert cli.build_parser().parse_args(["plan", "x.json"]).compile_cache is True
  assert cli.build_parser().parse_args(["--no-compile-cache", "plan", "x.json"]).compile_cache is False
  monkeypatch.setenv(user_cache.ENV, "off")
  assert program_store.default_folder() is None and user_cache.folder("head_plans") is None
  assert ProgramStore(None).load("any") is None
  monkeypatch.setenv(user_cache.ENV, str(tmp_path))
  assert program_store.default_folder() == tmp_path / "programs"
  monkeypatch.delenv(user_cache.ENV)
  assert program_store.default_folder() == Path.home() / ".cache" / "pasta_jax" / "programs" or os.environ.get(
      "XDG_CACHE_HOME")
