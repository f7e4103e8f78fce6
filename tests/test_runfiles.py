"""pasta_jax.model.runfiles: torn JSONL lines cut before appending, whole-file and whole-folder replacement that a
failure (or a kill) leaves undone, and resumes under changed settings refused by name."""

from __future__ import annotations

import json

import pytest

from pasta_jax.errors import ConfigError, PastaError
from pasta_jax.model import runfiles


def test_a_torn_last_line_is_cut_before_the_next_append(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"id": 1}\n{"id": 2, "te')  # a kill cut row 2 short
  runfiles.append_row(path, {"id": 3})
  assert path.read_text() == '{"id": 1}\n{"id": 3}\n'
  path.write_text('{"id": 1}\n{"id": 2, "te\n')  # an older reader ended the torn row with a newline
  runfiles.append_row(path, {"id": 3})
  assert path.read_text() == '{"id": 1}\n{"id": 3}\n'
  path.write_text('{"id": 1}\n{"id": 2}')  # whole but unterminated: the writer never finished it, so it is cut too
  assert [r["id"] for r in runfiles.read_rows(path)] == [1]
  assert path.read_text() == '{"id": 1}\n'
  assert not runfiles.cut_torn_tail(path)  # a clean file stays as it is


def test_a_torn_line_longer_than_the_read_chunk_is_found_and_cut(tmp_path):
  path = tmp_path / "rows.jsonl"
  long = json.dumps({"id": 1, "text": "x" * 200_000})
  path.write_text(long + "\n" + long[:150_000])
  assert runfiles.cut_torn_tail(path)
  assert path.read_text() == long + "\n"
  path.write_text(long[:150_000])  # the only line, torn
  assert runfiles.cut_torn_tail(path) and path.read_text() == ""


def test_append_rows_writes_all_rows_or_cuts_the_torn_remainder(tmp_path):
  path = tmp_path / "rows.jsonl"
  runfiles.append_rows(path, [{"id": i} for i in range(3)])
  with open(path, "a") as f:
    f.write('{"id": 3}\n{"id"')  # half of a second batch
  assert [r["id"] for r in runfiles.read_rows(path)] == [0, 1, 2, 3]
  runfiles.append_rows(path, [{"id": 4}])
  assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
  path = tmp_path / "report.json"
  runfiles.write_atomic(path, "old\n")

  def half_then_fail(tmp):
    tmp.write_text("ne")
    raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    runfiles.save_atomic(path, half_then_fail)
  assert path.read_text() == "old\n"
  assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
  runfiles.write_atomic(path, "new\n")
  assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_save_atomic_keeps_the_suffix_numpy_would_add(tmp_path):
  import numpy as np
  path = runfiles.save_atomic(tmp_path / "cache.npz", lambda tmp: np.savez(tmp, a=np.arange(3)))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.npz"]
  with np.load(path) as saved:
    assert saved["a"].tolist() == [0, 1, 2]


def test_a_folder_is_published_whole_with_its_marker_last_and_the_old_one_kept_on_failure(tmp_path):
  folder = tmp_path / "model"
  with runfiles.publishing(folder) as tmp:
    (tmp / "weights").write_text("v1")
  assert runfiles.is_complete(folder) and (folder / "weights").read_text() == "v1"
  with pytest.raises(RuntimeError), runfiles.publishing(folder) as tmp:
    (tmp / "weights").write_text("v2 (half")
    raise RuntimeError("export failed")
  assert (folder / "weights").read_text() == "v1" and runfiles.is_complete(folder)
  with runfiles.publishing(folder) as tmp:
    (tmp / "weights").write_text("v2")
  assert sorted(p.name for p in folder.iterdir()) == [runfiles.COMPLETE, "weights"]
  assert (folder / "weights").read_text() == "v2"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary or old folder left
  (folder / runfiles.COMPLETE).unlink()  # a kill between the rename and the marker: not done
  assert not runfiles.is_complete(folder)


def test_a_changed_setting_is_refused_naming_it_then_and_now(tmp_path):
  runfiles.claim(tmp_path, {"seed": 0, "lr": 0.1, "steps": 3})
  runfiles.claim(tmp_path, {"seed": 0, "lr": 0.1, "steps": 3})  # the same run resumes
  with pytest.raises(runfiles.RunDirError, match=r"lr: 0\.1 then, 0\.2 now; steps: 3 then, 4 now") as refused:
    runfiles.claim(tmp_path, {"seed": 0, "lr": 0.2, "steps": 4})
  assert "seed" not in str(refused.value) and isinstance(refused.value, PastaError)
  # a setting added since the run began resumes at its default, and only there
  runfiles.claim(tmp_path, {"seed": 0, "lr": 0.1, "steps": 3, "width": 0}, defaults={"width": 0})
  with pytest.raises(runfiles.RunDirError, match="width: 0 then, 8 now"):
    runfiles.claim(tmp_path, {"seed": 0, "lr": 0.1, "steps": 3, "width": 8}, defaults={"width": 0})
  # a field the saved run predates counts as its default; ignored fields may change
  runfiles.check_settings({"a": 1}, {"a": 1, "b": 2}, "run", defaults={"b": 2})
  runfiles.check_settings({"a": 1, "mesh": [1]}, {"a": 1, "mesh": [8]}, "run", ignore=("mesh",))
  with pytest.raises(runfiles.RunDirError, match="b: 2 then, 3 now"):
    runfiles.check_settings({"a": 1}, {"a": 1, "b": 3}, "run", defaults={"b": 2})


def test_a_training_resume_under_another_training_config_is_refused_by_field(tmp_path):
  import jax.numpy as jnp
  import optax

  from pasta_jax.model.config import get_config
  from pasta_jax.training.checkpoints import TrainCheckpoints
  from pasta_jax.training.config import TrainConfig
  from pasta_jax.training.state import init_state
  model = get_config("tiny-gemma3")
  config = TrainConfig(model="tiny", batch_size=4, seq_len=112, num_threads=4, learning_rate=1e-3)
  saved = TrainCheckpoints(tmp_path, model, config)
  saved.save(2, init_state({"w": jnp.zeros(3)}, optax.adam(1e-3)), force=True)
  saved.wait()
  TrainCheckpoints(tmp_path, model, config.replace(save_every=7, log_every=3)).check_compatible(2)  # how it runs
  changed = config.replace(learning_rate=2e-3, seed=1)
  with pytest.raises(ConfigError, match=r"learning_rate: 0\.001 then, 0\.002 now; seed: 0 then, 1 now"):
    TrainCheckpoints(tmp_path, model, changed).check_compatible(2)


def test_kill_points_count_per_label(monkeypatch):
  monkeypatch.setattr(runfiles, "_kill_counts", {})
  monkeypatch.setenv(runfiles.KILL_ENV, "append/pairs.jsonl:2")
  assert [runfiles.kill_due("append", name) for name in ("pairs.jsonl", "scores.jsonl", "pairs.jsonl")] == [
      False, False, True]
  monkeypatch.setenv(runfiles.KILL_ENV, "write:1")
  assert runfiles.kill_due("write", "a.json") and not runfiles.kill_due("write", "b.json")
