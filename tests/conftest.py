"""Test-wide settings.

fp32 matmuls run at full precision: on GPUs XLA would otherwise use TF32 for fp32 (about 1e-3
relative error), and the parity tests (training forward == decode replay, ours == transformers)
compare fp32 logits to 1e-4. On CPU this changes nothing.
"""

import gc
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The suite is bound by XLA:CPU compile time (thousands of small programs, each run a few times: 60% of the
# suite's time went to the backend compile in bench.suite_profile's profile). Three settings compile them faster and
# change no semantics (XLA's HLO passes all run, no fast-math): LLVM's optimization level 0 (about twice as fast),
# the older elemental fusion emitters in place of the MLIR ones, and one LLVM module per program instead of a
# split for parallel codegen (which 2 busy cores cannot use). The latter two took a test file's compile time from
# 20.9 s to 9.1 s. The benches and `pasta` commands keep XLA's defaults, and so do tests marked `production_xla`,
# which read the compiled program itself (a subprocess without these flags runs them). Set before the first
# computation initializes the backend; a user's own XLA_FLAGS win.
TEST_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                  "xla_cpu_parallel_codegen_split_count": "1"}
PRODUCTION_ENV = "PASTA_TEST_PRODUCTION_XLA"  # set in the subprocess that runs a production_xla test
# The flags before the suite added its own (xdist's workers inherit the controller's environment, already extended).
USER_XLA_FLAGS = os.environ.setdefault("PASTA_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
if not os.environ.get(PRODUCTION_ENV):
  os.environ["XLA_FLAGS"] = " ".join([USER_XLA_FLAGS] + [f"--{name}={value}" for name, value in TEST_XLA_FLAGS.items()
                                                         if name not in USER_XLA_FLAGS]).strip()

# The output head's form per row count is measured per process on a CPU (model/head_plan.py); the suite pins the
# fixed plan so every worker runs the same forms, and the certified tests reach the narrow head at 2+ rows.
# tests/test_head_plan.py measures it explicitly.
os.environ.setdefault("PASTA_HEAD_PLAN", "fixed")
# Compiled loops and head plans are kept in the user's cache by default (pasta_jax/model/user_cache.py); the suite
# neither reads nor writes it (tests/test_program_store.py turns it on in a temporary folder).
os.environ["PASTA_COMPILE_CACHE"] = "off"
# Both workers compile many of the same programs (the tiny models' loops at the same shapes), and a worker compiles
# again what the memory-maps guard below dropped. JAX's persistent cache, in one folder per suite run, reads them
# back: 2,988 of 10,941 compiles were hits, and the suite took 21.6-22.6 min on 2 cores against 25.8 without it. The
# folder is the run's own (made by the first process, inherited by xdist's workers and by the processes tests start,
# removed at the end), so the suite neither reads nor writes a user's cache. A hit runs what a compile would have
# built: the key covers the program, its compile options, the backend and XLA's flags.
SUITE_CACHE_ENV = "PASTA_TEST_XLA_CACHE"
_OWN_SUITE_CACHE = None if os.environ.get(SUITE_CACHE_ENV) else tempfile.mkdtemp(prefix="pasta-suite-xla-")
if _OWN_SUITE_CACHE:
  os.environ[SUITE_CACHE_ENV] = _OWN_SUITE_CACHE
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SUITE_CACHE_ENV]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny models' programs compile in < 1 s

import jax  # noqa: E402

from pasta_jax.decode import api  # noqa: E402
from pasta_jax.serve.programs import ProgramGuard  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ[SUITE_CACHE_ENV])  # (if jax was imported before)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# On CPU each compiled XLA kernel holds three memory maps, and Linux allows a process 65,530: a test worker that
# keeps every program it compiled reached the limit in about 700 tests, and its next compile crashed the worker
# (one worker held 65,476 maps when it died). Past half the limit, a test's teardown drops the
# compiled programs (later tests recompile what they need): the guard `pasta serve` keeps, read after every test.


def _drop_programs() -> None:
  jax.clear_caches()
  api.COMPILED.clear()
  gc.collect()


_MAPS_GUARD = ProgramGuard(high_water=0.5, every_s=0.0, drop=_drop_programs)


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
  yield
  _MAPS_GUARD.check()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """A `production_xla` test runs in a fresh `pytest` process without the test-only XLA flags."""
  if os.environ.get(PRODUCTION_ENV) or pyfuncitem.get_closest_marker("production_xla") is None:
    return None
  env = {**os.environ, PRODUCTION_ENV: "1", "XLA_FLAGS": USER_XLA_FLAGS}
  # (one test, in one process: none of the suite's addopts, whose --dist needs xdist)
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                         "-o", "addopts=", pyfuncitem.nodeid],
                        env=env, cwd=pyfuncitem.config.rootpath, capture_output=True, text=True)
  if done.returncode != 0:
    pytest.fail(f"under XLA's default flags:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}", pytrace=False)
  return True


def pytest_sessionfinish(session):
  """The process that made the suite's compile cache removes it."""
  if _OWN_SUITE_CACHE:
    shutil.rmtree(_OWN_SUITE_CACHE, ignore_errors=True)
