"""Judges by name: auto and none build nothing, local judges load their model through the caller's loader,
and every judge is cached in the run folder."""

from __future__ import annotations

import types

import pytest

from pasta_jax.errors import PastaError
from pasta_jax.judges import CachedJudge, factory
from pasta_jax.judges.factory import VERDICTS_FILE, make_judge


def no_model(path):
  pytest.fail(f"loaded a model ({path}) for a judge that needs none")


def test_auto_and_none_build_no_judge(tmp_path, monkeypatch):
  monkeypatch.delenv(factory.JUDGE_URL_ENV, raising=False)
  judge, note = make_judge("auto", tmp_path, no_model)
  assert judge is None and factory.JUDGE_URL_ENV in note
  assert make_judge("none", tmp_path, no_model) == (None, "--judge none.")
  with pytest.raises(PastaError, match="unknown judge 'oracle'"):
    make_judge("oracle", tmp_path, no_model)


def test_a_local_judge_loads_its_model_through_the_callers_loader(tmp_path, monkeypatch):
  monkeypatch.setattr(factory, "LocalJudge", lambda model: types.SimpleNamespace(name="local:fake", model=model))
  loaded = []
  load = lambda path: loaded.append(path) or f"model at {path}"  # noqa: E731
  judge, note = make_judge("local:some/model", tmp_path, load)
  assert isinstance(judge, CachedJudge) and judge.inner.model == "model at some/model" and note == ""
  assert judge.path == tmp_path / VERDICTS_FILE
  judge, note = make_judge("local", tmp_path, load)
  assert judge.inner.model == "model at None" and "not a meaningful judge" in note
  assert loaded == ["some/model", None]
