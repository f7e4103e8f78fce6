"""Adapters: LoRA + embedding rows over a frozen base (model/lora.py, the trainer's adapter runs)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.errors import ConfigError, WeightsError
from pasta_jax.model import lora
from pasta_jax.model.checkpoint import save_checkpoint
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import generation_defaults, load_model
from pasta_jax.model.partitioning import param_specs
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.trainer import Trainer, adapter_config
from tests import training_data
from tests.tiny import tiny_model
from tests.train_worker import cyclic

ROWS = (10, 11, 12, 57)  # a few tag ids of the tiny vocab (tags start at 10)


def _inputs(model, length: int = 12):
  tokens = jnp.asarray([[2] + list(range(10, 10 + length - 1))], jnp.int32)  # tag tokens, so the rows matter
  positions = jnp.arange(length)[None]
  mask = jnp.tril(jnp.ones((1, length, length), bool))
  return tokens, positions, mask


def _random_adapter(model, config, seed=1):
  """An adapter with every leaf nonzero (a fresh one has B = 0 and rows = 0)."""
  adapter = lora.init_adapter(model.params, config, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(treedef, [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.mark.parametrize("name", ["tiny-gemma1", "tiny-gemma3"])
def test_fresh_adapter_gives_the_base_logits_exactly(name):
  model = tiny_model(name)
  config = lora.AdapterConfig(rank=4, alpha=8.0, targets=lora.TARGETS, row_ids=ROWS)
  adapter = lora.init_adapter(model.params, config, jax.random.key(0))
  inputs = _inputs(model)
  base = Gemma(model.config).apply(model.params, *inputs).logits
  tuned = Gemma(model.config, adapter=config).apply(lora.merge(model.params, adapter), *inputs).logits
  np.testing.assert_array_equal(np.asarray(tuned), np.asarray(base))


@pytest.mark.parametrize("targets", [lora.ATTENTION, lora.TARGETS])
def test_folded_equals_unfolded_forward(targets):
  model = tiny_model("tiny-gemma3")
  config = lora.AdapterConfig(rank=4, alpha=8.0, targets=targets, row_ids=ROWS)
  adapter = _random_adapter(model, config)
  inputs = _inputs(model)
  unfolded = Gemma(model.config, adapter=config).apply(lora.merge(model.params, adapter), *inputs).logits
  folded = Gemma(model.config).apply(lora.fold(model.params, adapter, config), *inputs).logits
  base = Gemma(model.config).apply(model.params, *inputs).logits
  assert float(jnp.max(jnp.abs(unfolded - base))) > 1e-2  # the adapter really changes the model
  np.testing.assert_allclose(np.asarray(folded), np.asarray(unfolded), atol=2e-5, rtol=2e-5)


def test_split_undoes_merge():
  model = tiny_model()
  config = lora.AdapterConfig(rank=2, row_ids=ROWS)
  adapter = lora.init_adapter(model.params, config, jax.random.key(0))
  base, back = lora.split(lora.merge(model.params, adapter))
  assert jax.tree.structure(base) == jax.tree.structure(model.params)
  assert jax.tree.structure(back) == jax.tree.structure(adapter)


def _adapter_trainer(out_dir, steps: int = 4, **fields):
  model = tiny_model()
  config = TrainConfig(model="tiny", batch_size=4, seq_len=112, num_threads=4, learning_rate=1e-2, save_every=2,
                       lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS, **fields)
  data = cyclic(training_data.batches(model.tokenizer), steps)
  trainer = Trainer(config, model, data, out_dir, check_memory=False, progress=False)
  trainer._mfu = lambda tokens, seconds: 0.0
  return trainer


def test_gradients_reach_only_the_adapter(tmp_path):
  trainer = _adapter_trainer(tmp_path)
  base_before = jax.tree.map(np.asarray, trainer.model.params)
  fresh = jax.tree.map(np.asarray, trainer.state.params)
  result = trainer.run(stop_after=3)
  assert result.losses[-1] < result.losses[0]
  # the optimizer holds adapter leaves only, and the frozen base it trains over is untouched
  names = {str(p[-1].key) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.state.params)[0]}
  assert names and all(lora.is_adapter_leaf(n) for n in names)
  for before, now in zip(jax.tree.leaves(base_before), jax.tree.leaves(trainer.frozen)):
    np.testing.assert_array_equal(before, np.asarray(now))
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(b) - a))), fresh, trainer.state.params)
  assert all(v > 0 for v in jax.tree.leaves(moved))  # every B, A and the rows learned
  opt_sizes = sum(x.size for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim > 0)
  assert opt_sizes == 2 * sum(x.size for x in jax.tree.leaves(trainer.state.params))  # Adam: mu and nu


def test_adapter_export_loads_folded_and_resumes(tmp_path):
  base_dir = tmp_path / "base"
  model = tiny_model()
  save_checkpoint(base_dir, model.params, model.config)
  trainer = _adapter_trainer(tmp_path / "run")
  trainer.model = trainer.model._replace(source=str(base_dir))
  result = trainer.run()
  loaded = load_model(result.model_dir, with_tokenizer=False)
  assert loaded.adapter is not None and loaded.adapter.config == trainer.adapter
  want = lora.fold(model.params, jax.device_get(trainer.state.params), trainer.adapter)
  for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert lora.adapter_bytes(loaded.adapter.tree) < 0.5 * sum(x.size * 4 for x in jax.tree.leaves(model.params))
  # a PASTA model says how it is decoded: the interpreter, in the position mode it was trained in
  assert generation_defaults(loaded) == {"method": "pasta", "position_mode": "pred"}
  fixed = _adapter_trainer(tmp_path / "fixed", steps=1, position_mode="fixed")
  fixed.model = fixed.model._replace(source=str(base_dir))
  assert generation_defaults(load_model(fixed.run().model_dir, with_tokenizer=False))["position_mode"] == "fixed"


def test_a_run_goes_on_training_a_models_adapter_with_its_rows(tmp_path):
  """A model loaded with an adapter trains on with the adapter's own rows when the run's tag rows differ (the
  tag vocabulary grew since); a different rank is refused."""
  base_dir = tmp_path / "base"
  model = tiny_model()
  save_checkpoint(base_dir, model.params, model.config)
  first = _adapter_trainer(tmp_path / "first", train_rows=())
  first.model = first.model._replace(source=str(base_dir))
  loaded = load_model(first.run().model_dir, with_tokenizer=False)._replace(tokenizer=model.tokenizer)
  assert loaded.adapter.config.row_ids == ()
  config = TrainConfig(model="tiny", lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS)
  assert adapter_config(config, model).row_ids  # a fresh run would train the tag rows
  assert adapter_config(config, loaded) == loaded.adapter.config
  data = cyclic(training_data.batches(model.tokenizer), 2)
  goes_on = Trainer(config, loaded, data, tmp_path / "second", check_memory=False, progress=False)
  assert goes_on.adapter == loaded.adapter.config
  with pytest.raises(ConfigError, match="the run asks for"):
    Trainer(config.replace(lora_rank=2), loaded, data, tmp_path / "third", check_memory=False, progress=False)


def test_adapter_run_resumes_from_its_checkpoint(tmp_path):
  first = _adapter_trainer(tmp_path / "a", steps=6)
  first.run(stop_after=2)
  resumed = _adapter_trainer(tmp_path / "a", steps=6)
  assert resumed.resumed_from == 2
  after = resumed.run(stop_after=5).losses
  straight = _adapter_trainer(tmp_path / "b", steps=6).run(stop_after=5).losses
  assert after == straight[2:]


def test_kl_term_is_zero_for_a_fresh_adapter_and_grows(tmp_path):
  trainer = _adapter_trainer(tmp_path, steps=5, kl_weight=0.2)
  result = trainer.run(stop_after=4)
  from pasta_jax.training.metrics_log import read_metrics
  kls = [row["kl"] for row in read_metrics(tmp_path)]
  # LoRA's B starts at zero, so the KL grows from exactly 0, slowly at first (3-layer tiny model:
  # about 3e-12, 2e-9, 9e-8 after steps 1 to 3)
  assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-8
  assert all(later > earlier for earlier, later in zip(kls[1:], kls[2:]))
  assert result.losses[-1] < result.losses[0]


def test_adapter_partitioning_follows_the_base():
  model = tiny_model()
  config = lora.AdapterConfig(rank=4, targets=lora.TARGETS, row_ids=ROWS)
  adapter = jax.eval_shape(lambda: lora.init_adapter(model.params, config, jax.random.key(0)))
  specs = param_specs(adapter, {"data": 1, "fsdp": 2, "tensor": 2})
  layer = specs["params"]["layer_0"]
  assert tuple(layer["attn"]["q_lora_a"]) == ("fsdp", None)  # [embed, rank]
  assert tuple(layer["attn"]["q_lora_b"]) == (None, "tensor", None)  # [rank, heads, head_dim]
  assert tuple(layer["mlp"]["down_lora_a"]) == ("tensor", None)  # [mlp, rank]


def test_bad_adapters_are_refused(tmp_path):
  with pytest.raises(ConfigError, match="unknown LoRA targets"):
    lora.AdapterConfig(targets=("qq",))
  with pytest.raises(ConfigError, match="kl_weight needs an adapter"):
    TrainConfig(kl_weight=0.2)
  other = tiny_model("tiny-gemma1")
  adapter = lora.init_adapter(other.params, lora.AdapterConfig(rank=2), jax.random.key(0))
  with pytest.raises(WeightsError, match="another model"):
    lora.check_matches(tiny_model("tiny-gemma3").params, adapter, "x")


def test_generation_defaults_come_from_the_models_folder(tmp_path):
  from pasta_jax.errors import WeightsError
  from pasta_jax.model.load import LoadedModel, generation_defaults

  model = LoadedModel(None, {}, None, str(tmp_path))
  assert generation_defaults(model) == {}
  (tmp_path / "generation.json").write_text('{"repetition_penalty": 1.1, "why": "measured"}')
  assert generation_defaults(model) == {"repetition_penalty": 1.1}
  (tmp_path / "generation.json").write_text('{"repetition_penalty": 1.1, "temprature": 2}')
  with pytest.raises(WeightsError, match="temprature"):
    generation_defaults(model)


def test_pasta_generate_takes_the_folders_penalty_unless_the_flag_is_given(tmp_path, capsys):
  import argparse

  from pasta_jax.commands.generate import _model_defaults, _sampling
  from pasta_jax.methods import Pasta
  from pasta_jax.model.load import LoadedModel

  (tmp_path / "generation.json").write_text('{"repetition_penalty": 1.1}')
  model = LoadedModel(None, {}, None, str(tmp_path))
  args = argparse.Namespace(temperature=0.0, top_k=0, top_p=1.0, seed=0, repetition_penalty=None)
  assert _model_defaults(_sampling(args), args, model, Pasta()).repetition_penalty == 1.1
  said = capsys.readouterr().err
  assert "generation.json" in said and "--repetition-penalty 1 turns it off" in said  # said aloud, with its way out
  assert "--no-distinct-topics" not in said  # no flag named for what the folder did not set
  args.repetition_penalty = 1.0
  assert _model_defaults(_sampling(args), args, model, Pasta()).repetition_penalty == 1.0


def test_pasta_generate_takes_the_folders_distinct_topics_for_pasta_only(tmp_path, capsys):
  import argparse

  from pasta_jax.commands.generate import _model_defaults, _sampling
  from pasta_jax.methods import Pasta, PastaTrees
  from pasta_jax.model.load import LoadedModel

  (tmp_path / "generation.json").write_text('{"distinct_topics": true}')
  model = LoadedModel(None, {}, None, str(tmp_path))
  args = argparse.Namespace(temperature=0.0, top_k=0, top_p=1.0, seed=0, repetition_penalty=None, distinct_topics=None)
  assert _model_defaults(_sampling(args), args, model, Pasta()).distinct_topics
  said = capsys.readouterr().err
  assert "distinct topics" in said and "--no-distinct-topics turns it off" in said  # said aloud, with its way out
  assert not _model_defaults(_sampling(args), args, model, PastaTrees()).distinct_topics  # it cannot keep it
  args.distinct_topics = False  # --no-distinct-topics
  assert not _model_defaults(_sampling(args), args, model, Pasta()).distinct_topics


def test_pasta_generate_decodes_with_the_method_the_models_folder_names(tmp_path, capsys):
  import argparse

  from pasta_jax.commands.generate import _method
  from pasta_jax.errors import PastaError
  from pasta_jax.methods import Medusa, Pasta, Sequential
  from pasta_jax.model.load import LoadedModel

  model = LoadedModel(None, {}, None, str(tmp_path))
  args = argparse.Namespace(method=None, pasta=False)
  assert _method(args, model) == Sequential() and capsys.readouterr().err == ""  # no folder setting: plain
  (tmp_path / "generation.json").write_text('{"method": "pasta"}')
  assert _method(args, model) == Pasta()
  said = capsys.readouterr().err
  assert "generation.json" in said and "--method sequential" in said  # said aloud, with its way out
  for flags, want in (({"method": "sequential"}, Sequential()), ({"method": "medusa"}, Medusa()),
                      ({"pasta": True}, Pasta())):
    assert _method(argparse.Namespace(**{"method": None, "pasta": False, **flags}), model) == want
  with pytest.raises(PastaError, match="disagree"):
    _method(argparse.Namespace(method="medusa", pasta=True), model)
  (tmp_path / "generation.json").write_text('{"method": "telepathy"}')
  with pytest.raises(PastaError, match="generation.json: unknown method 'telepathy'"):
    _method(args, model)


def test_pasta_decodes_a_model_in_the_position_mode_its_folder_names_unless_told(tmp_path):
  from pasta_jax.errors import PastaError
  from pasta_jax.methods import Pasta, Setup
  from pasta_jax.model.load import LoadedModel

  model = LoadedModel(None, {}, None, str(tmp_path))
  assert Pasta().setup(model, Setup()).position_mode == "pred"  # no folder setting: the paper's Pred-10x
  for mode in ("fixed", "pred-1x"):
    (tmp_path / "generation.json").write_text(json.dumps({"method": "pasta", "position_mode": mode}))
    assert Pasta().setup(model, Setup()).position_mode == mode
  assert Pasta(position_mode="pred").setup(model, Setup()).position_mode == "pred"  # given: kept
  (tmp_path / "generation.json").write_text('{"position_mode": "sideways"}')
  with pytest.raises(PastaError, match="generation.json: unknown position_mode 'sideways'"):
    Pasta().setup(model, Setup())


def test_the_shipped_pasta_adapters_name_the_interpreter_and_the_baseline_does_not():
  from pasta_jax.model import load
  for name in load.shipped_names():
    model = load.LoadedModel(None, {}, None, str(load.shipped_adapter(name)))
    assert load.generation_defaults(model).get("method", "sequential") == (
        "sequential" if name == "baseline-sft" else "pasta"), name


def test_pasta_generate_says_when_promises_went_unkept_outside_the_interpreter():
  from pasta_jax.commands.generate import unkept_promises_note
  answer = '1. <promise topic="Eat a balanced" tokens="10"/>2. <promise topic="Move" tokens="10"/>3. Drink water.'
  note = unkept_promises_note(answer, "sequential")
  assert "2 promises" in note and "--pasta" in note and "missing" in note
  assert unkept_promises_note("1. Eat. 2. Move. 3. Drink water.", "sequential") == ""
