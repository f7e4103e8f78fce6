"""A resumed training run reads its compiled steps back from the persistent cache instead of compiling them."""

from __future__ import annotations

import jax
import jax.monitoring
import pytest
from jax.experimental.compilation_cache import compilation_cache

from pasta_jax.model import user_cache
from pasta_jax.training import compile_cache
from tests import train_worker


class CompileCount:
  """Programs compiled or read back, and persistent-cache hits among them, while `on`."""

  def __init__(self):
    self.on, self.compiles, self.hits = False, 0, 0
    jax.monitoring.register_event_duration_secs_listener(self.duration)
    jax.monitoring.register_event_listener(self.event)

  def duration(self, event: str, seconds: float, **kwargs):
    self.compiles += self.on and event.endswith("backend_compile_duration")  # recorded for a hit too

  def event(self, event: str, **kwargs):
    self.hits += self.on and event == "/jax/compilation_cache/cache_hits"

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self.duration)
    jax.monitoring.unregister_event_listener(self.event)


@pytest.fixture
def cache_settings():
  """JAX's cache settings are the process's: put them back for the tests after this one."""
  names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size", "jax_persistent_cache_min_compile_time_secs")
  before = {name: getattr(jax.config, name) for name in names}
  jax.config.update("jax_compilation_cache_dir", None)  # not the suite's own cache (tests/conftest.py)
  compilation_cache.reset_cache()
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def test_a_resumed_run_reads_its_steps_back_instead_of_compiling_them(tmp_path, monkeypatch, cache_settings):
  monkeypatch.setenv(user_cache.ENV, str(tmp_path / "cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the tiny model's step compiles in < 1 s
  count = CompileCount()
  first = train_worker.make_trainer(str(tmp_path / "run"), 40)
  assert first.compile_cache == tmp_path / "cache" / compile_cache.PART
  first.run(stop_after=2)
  assert any((tmp_path / "cache" / compile_cache.PART).iterdir())
  jax.clear_caches()  # as a new process: nothing compiled in memory
  resumed = train_worker.make_trainer(str(tmp_path / "run"), 40)
  assert resumed.resumed_from == 2
  count.on = True
  resumed.run(stop_after=4)
  count.close()
  assert count.hits == count.compiles > 0, (count.hits, count.compiles)  # every program was read back


def test_the_cache_stays_off_where_the_user_turned_it_off_or_chose_another(tmp_path, monkeypatch, cache_settings):
  monkeypatch.setenv(user_cache.ENV, "off")
  jax.config.update("jax_compilation_cache_dir", None)
  assert compile_cache.keep_compiled_programs() is None and not jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
  monkeypatch.setenv(user_cache.ENV, str(tmp_path / "ours"))
  assert compile_cache.keep_compiled_programs() == tmp_path / "theirs"
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
