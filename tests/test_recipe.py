"""train.recipe's BoNBoN stage: the flags it hands train.bonbon, and one set of samples for every lambda."""

from __future__ import annotations

import json

from train import bonbon, recipe


def test_every_lambda_after_the_first_starts_from_the_first_ones_samples(tmp_path, monkeypatch):
  (tmp_path / "records").mkdir()
  (tmp_path / "records" / "train.jsonl").write_text(json.dumps({"id": "0", "instruction": "hi", "output": "o"}) + "\n")
  calls = []

  def fake_bonbon(flags):
    calls.append(flags)
    out = flags[flags.index("--out") + 1]
    samples = tmp_path / out / "round_1" / "pairs" / "samples.jsonl"
    if not samples.exists():  # the first lambda samples; later ones must find these rows already there
      samples.parent.mkdir(parents=True)
      samples.write_text(f'{{"id": "0", "sampled_for": "{out}"}}\n')
    return 0

  monkeypatch.setattr(bonbon, "main", fake_bonbon)
  args = recipe.parse_args(["--out", str(tmp_path), "--lambdas", "0,2", "--quality-measure", "rouge"])
  recipe.stage_bonbon(args, tmp_path)
  assert [f[f.index("--quality-weight") + 1] for f in calls] == ["0.0", "2.0"]
  assert all(f[f.index("--quality-measure") + 1] == "rouge" for f in calls)
  assert all(f[f.index("--rounds") + 1] == "1" for f in calls)
  calls.clear()
  recipe.stage_bonbon(recipe.parse_args(["--out", str(tmp_path), "--lambdas", "2", "--bonbon-rounds", "2"]), tmp_path)
  assert calls[0][calls[0].index("--rounds") + 1] == "2"
  first, second = (tmp_path / f"bonbon_l{lam}" / "round_1" / "pairs" / "samples.jsonl" for lam in (0, 2))
  assert second.read_text() == first.read_text() and "bonbon_l0" in first.read_text()
  # a lambda that already has samples keeps its own
  second.write_text("mine\n")
  recipe.stage_bonbon(args, tmp_path)
  assert second.read_text() == "mine\n"


def test_ship_replaces_adapter_files_keeps_heads_and_never_deletes_what_it_ships(tmp_path, monkeypatch):
  from pasta_jax.model import load, lora
  shipped = tmp_path / "adapters"
  monkeypatch.setattr(load, "SHIPPED_DIR", shipped)
  for name in ("baseline-sft", "pasta-sft"):
    (shipped / name).mkdir(parents=True)
    for file in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
      (shipped / name / file).write_text(f"old {name}")
  (shipped / "pasta-sft" / "medusa").mkdir()
  (shipped / "pasta-sft" / "medusa" / "heads.json").write_text("heads")
  (shipped / "pasta-sft" / "generation.json").write_text('{"repetition_penalty": 1.1}')
  run = tmp_path / "run"
  (run / "baseline_sft").mkdir(parents=True)
  (run / "baseline_sft" / "model").symlink_to(shipped / "baseline-sft")  # a run that reuses the shipped adapter
  for rel in ("pasta_sft/model", "bonbon_l1/round_1/train/model"):
    (run / rel).mkdir(parents=True)
    for file in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
      (run / rel / file).write_text(f"new {rel}")
  (run / "pasta_sft/model/generation.json").write_text('{"method": "pasta", "position_mode": "pred"}')
  recipe.stage_ship(recipe.parse_args(["--out", str(run), "--ship-lambda", "1"]), run)
  assert (shipped / "baseline-sft" / lora.WEIGHTS_FILE).read_text() == "old baseline-sft"
  assert (shipped / "pasta-sft" / lora.WEIGHTS_FILE).read_text() == "new pasta_sft/model"
  assert (shipped / "pasta-sft" / "medusa" / "heads.json").read_text() == "heads"
  assert (shipped / "pasta-bon" / lora.CONFIG_FILE).read_text() == "new bonbon_l1/round_1/train/model"
  (run / "bonbon_l1/round_2/train/model").mkdir(parents=True)  # --bonbon-rounds 2 ships the last round's model
  for file in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
    (run / "bonbon_l1/round_2/train/model" / file).write_text("round 2")
  recipe.stage_ship(recipe.parse_args(["--out", str(run), "--ship-lambda", "1", "--bonbon-rounds", "2"]), run)
  assert (shipped / "pasta-bon" / lora.CONFIG_FILE).read_text() == "round 2"
  # the PASTA adapters recommend the interpreter (their other settings kept); the baseline recommends nothing
  assert json.loads((shipped / "pasta-sft" / "generation.json").read_text()) == {"repetition_penalty": 1.1,
                                                                                 "method": "pasta"}
  assert json.loads((shipped / "pasta-bon" / "generation.json").read_text()) == {"method": "pasta"}
  assert not (shipped / "baseline-sft" / "generation.json").exists()
  # a model trained in another position mode ships with it, so it is decoded in it
  (run / "bonbon_l1/round_2/train/model/generation.json").write_text('{"method": "pasta", "position_mode": "fixed"}')
  recipe.stage_ship(recipe.parse_args(["--out", str(run), "--ship-lambda", "1", "--bonbon-rounds", "2"]), run)
  assert json.loads((shipped / "pasta-bon" / "generation.json").read_text()) == {"method": "pasta",
                                                                                 "position_mode": "fixed"}


def test_pasta_sft_takes_its_kl_toward_this_runs_baseline_sft_once_that_is_trained(tmp_path, monkeypatch):
  import pytest

  from pasta_jax.errors import PastaError
  from train import sft
  calls = []
  monkeypatch.setattr(sft, "main", lambda flags: calls.append(flags) or 0)
  args = recipe.parse_args(["--out", str(tmp_path), "--pasta-kl-to-baseline", "0.5", "--kl-weight", "0.1",
                            "--grad-accum", "2"])
  with pytest.raises(PastaError, match="Baseline-SFT first"):
    recipe.stage_sft(args, tmp_path, "pasta_sft")
  (tmp_path / "baseline_sft" / "model").mkdir(parents=True)
  (tmp_path / "baseline_sft" / "model" / "COMPLETE").write_text("complete")
  recipe.stage_sft(args, tmp_path, "baseline_sft")
  recipe.stage_sft(args, tmp_path, "pasta_sft")
  baseline, pasta = calls
  assert baseline[baseline.index("--kl-weight") + 1] == "0.1" and "--kl-reference" not in baseline
  assert pasta.count("--kl-weight") == 1 and pasta[pasta.index("--kl-weight") + 1] == "0.5"
  assert pasta[pasta.index("--kl-reference") + 1] == str(tmp_path / "baseline_sft" / "model")
  assert all(flags[flags.index("--grad-accum") + 1] == "2" for flags in calls)  # the KL's memory in two halves
