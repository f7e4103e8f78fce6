"""bench.suite_profile: the plugin records what JAX compiled in each test, and the report sums it per file."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import suite_profile

ROOT = Path(__file__).resolve().parents[1]


def row(test, wall, compile_s=0.0, compiles=0, maps=100, pid=1):
  return {"test": test, "wall": wall, "pid": pid, "maps": maps, "compile": compile_s, "compile_n": compiles}


def test_the_report_sums_each_file_and_the_suite(capsys, tmp_path):
  rows = [row("tests/a.py::x", 2.0, 1.5, 3, maps=500), row("tests/a.py::y", 1.0, 0.5, 1, maps=700),
          row("tests/b.py::z", 4.0, 1.0, 2, maps=300, pid=2)]
  lines, totals = suite_profile.summarize(rows)
  assert lines[1].split()[:3] == ["4.0", "1.0", "2"] and lines[1].endswith("tests/b.py")  # slowest file first
  assert lines[2].split()[:3] == ["3.0", "2.0", "4"] and lines[2].endswith("tests/a.py")
  assert (totals["test_s"], totals["compile_s"], totals["compiles"]) == (7.0, 3.0, 6)
  assert (totals["peak_maps"], totals["workers"]) == (700, 2)
  path = tmp_path / "p.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  suite_profile.main(["--profile", str(path)])
  assert capsys.readouterr().out.splitlines()[-1] == "RESULT test_s=7 compile_s=3 compile_share=0.43 peak_maps=700"


def test_the_plugin_records_each_tests_compiles(tmp_path):
  (tmp_path / "test_one.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def test_compiles():\n  jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
      "def test_compiles_nothing():\n  pass\n")
  out = tmp_path / "profile.jsonl"
  env = {**os.environ, suite_profile.ENV: str(out), "PYTHONPATH": str(ROOT)}
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-p",
                         "bench.suite_profile", "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                        env=env, cwd=tmp_path, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout + done.stderr
  first, second = [json.loads(line) for line in out.read_text().splitlines()]
  assert first["test"].endswith("test_compiles") and first["compile_n"] >= 1 and first["compile"] > 0
  assert "compile_n" not in second  # a test's row counts only its own compiles
  if sys.platform == "linux":
    assert first["maps"] > 0

