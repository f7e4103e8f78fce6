"""The memory planner: tpu_configs fit their hardware, parameter bytes match real shapes, bad configs are refused."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pasta_jax.cli import main
from pasta_jax.errors import ConfigError
from pasta_jax.model.config import PRESETS
from pasta_jax.model.gemma import Gemma, causal_mask
from pasta_jax.model.mesh import MeshConfig
from pasta_jax.training.config import TrainConfig, load_train_config
from pasta_jax.training.losses import NO_TAGS, KlTags, sft_kl_loss_sum, sft_loss_sum
from pasta_jax.training.plan import (
  HARDWARE,
  KL_LOGIT_COPIES,
  check_fits,
  detect_hardware,
  format_plan,
  memory_plan,
  peak_flops_per_device,
  plan_for,
  resolve_model_config,
)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "tpu_configs"
CONFIGS = sorted(c for c in CONFIG_DIR.glob("*.json") if "_decode_" not in c.name)  # decode plans: test_decode_plan
REFUSED_MARK = "refused by the plan"  # a config whose comment says this is documented as not fitting
TINY = PRESETS["tiny-gemma3"]  # vocab 512, embed 64, mlp 128, 3 layers, 4 heads, 2 KV heads, head_dim 16


def tiny_config(**changes) -> TrainConfig:
  return TrainConfig(model="tiny-gemma3", hardware="cpu", batch_size=4, seq_len=32, num_threads=4).replace(**changes)


def real_leaves(config=TINY) -> list[jax.ShapeDtypeStruct]:
  """Parameter shapes from an abstract init of the model itself (independent of the planner)."""
  tokens = jnp.zeros((1, 4), jnp.int32)
  shapes = jax.eval_shape(Gemma(config).init, jax.random.key(1), tokens, tokens, causal_mask(1, 4))
  return jax.tree.leaves(shapes)


def elements(leaves) -> int:
  return sum(int(np.prod(x.shape)) for x in leaves)


# ------------------------------------------------------------------------------------------ tpu_configs


def test_configs_cover_every_target():
  names = {p.name for p in CONFIGS}
  for hardware in ("v4-8", "v5e-16", "v5p-8", "v6e-8", "h100x1", "h100x8"):
    for objective in ("sft", "bonbon"):
      assert f"gemma7b_{objective}_{hardware}.json" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_fits_its_hardware(path):
  fields = json.loads(path.read_text())
  config = load_train_config(path)
  assert config.model == "gemma1-7b" and config.hardware in HARDWARE
  assert config.batch_size == 8 and config.compute_dtype == "bfloat16"
  assert config.learning_rate == (1e-5 if config.objective == "sft" else 5e-7)
  assert fields.get("comment"), "every config says why it is shaped the way it is"
  model = resolve_model_config(config.model)
  if REFUSED_MARK in fields["comment"]:
    with pytest.raises(ConfigError, match="does not fit") as refused:
      check_fits(config, model)
    assert "headroom" in str(refused.value)  # the plan comes with the refusal
  else:
    plan = check_fits(config, model)
    assert plan.fits and plan.headroom >= 0
    assert (plan.reference > 0) == (config.objective == "bonbon")


# ---------------------------------------------------------------------------------------- param bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unsharded_parameter_bytes_equal_real_count(dtype):
  plan = memory_plan(tiny_config(param_dtype=dtype), TINY)
  expected = elements(real_leaves()) * jnp.dtype(dtype).itemsize
  assert plan.params == expected == plan.grads
  assert elements(real_leaves()) == TINY.param_count()


def test_optimizer_holds_two_moments():
  update = 2 * 4 * max(int(np.prod(x.shape)) for x in real_leaves())  # the update's working set
  f32 = memory_plan(tiny_config(), TINY)
  assert 2 * f32.params + update <= f32.optimizer <= 2 * f32.params + update + 64  # mu, nu (+ scalar counts)
  mu16 = memory_plan(tiny_config(mu_dtype="bfloat16"), TINY)
  assert 1.5 * mu16.params + update <= mu16.optimizer <= 1.5 * mu16.params + update + 64


def _split(leaves_with_names, predicate) -> int:
  return sum(int(np.prod(leaf.shape)) for name, leaf in leaves_with_names if predicate(name))


def test_sharded_parameter_bytes_shrink_by_the_mesh():
  named = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
      jax.eval_shape(Gemma(TINY).init, jax.random.key(1), jnp.zeros((1, 4), jnp.int32),
                     jnp.zeros((1, 4), jnp.int32), causal_mask(1, 4)))[0]]
  norms = _split(named, lambda n: n.endswith("['scale']"))  # 1-D norm scales stay replicated
  kv = _split(named, lambda n: n.endswith("['k']") or n.endswith("['v']"))
  rest = elements(leaf for _, leaf in named) - norms
  f32 = 4
  plan = memory_plan(tiny_config(mesh=MeshConfig(1, 2, 2)), TINY)  # every weight splits 4 ways
  assert plan.params == f32 * (rest // 4 + norms)
  # tensor=4 cannot split 2 KV heads: K and V are replicated over tensor and count fully.
  plan = memory_plan(tiny_config(mesh=MeshConfig(1, 1, 4)), TINY)
  assert plan.params == f32 * ((rest - kv) // 4 + kv + norms)


def test_non_dividing_mesh_is_refused():
  with pytest.raises(ConfigError, match="does not divide over mesh axis tensor of size 3"):
    memory_plan(tiny_config(mesh=MeshConfig(1, 1, 3)), TINY)


# ------------------------------------------------------------------------------------------ estimates


def test_remat_tensor_and_bonbon_move_the_estimate_the_right_way():
  base = memory_plan(tiny_config(), TINY)
  assert memory_plan(tiny_config(remat=True), TINY).activations < base.activations
  assert memory_plan(tiny_config(mesh=MeshConfig(1, 1, 2)), TINY).activations < base.activations
  bonbon = memory_plan(tiny_config(objective="bonbon"), TINY)
  assert bonbon.activations > base.activations and bonbon.reference > 0 and base.reference == 0
  assert base.total == base.params + base.grads + base.optimizer + base.activations + base.batch


def test_the_kl_term_is_planned_per_micro_batch_and_refused_with_its_remedy():
  kl = dict(lora_rank=4, kl_weight=1.0)
  plain = memory_plan(tiny_config(lora_rank=4), TINY)
  toward = {tags: memory_plan(tiny_config(objective=objective, **kl), TINY)
            for tags, objective in ((True, "sft"), (False, "baseline_sft"))}
  logits = 4 * 32 * TINY.vocab_size * 4  # [b, L, V] f32
  for tags, with_kl in toward.items():
    extra = dict(with_kl.parts)["KL: reference forward, its logits and the KL's terms"]
    assert extra >= KL_LOGIT_COPIES[tags] * logits
    assert with_kl.activations - extra == plain.activations
  halved = memory_plan(tiny_config(grad_accum=2, **kl), TINY)
  assert dict(halved.parts)["KL: reference forward, its logits and the KL's terms"] * 2 == \
         dict(toward[True].parts)["KL: reference forward, its logits and the KL's terms"]
  assert "KL" not in format_plan(plain) and "KL: reference forward" in format_plan(toward[True])
  # the 270M at batch 8 x 320 (a 24 GiB host's job): with the KL it needs two micro-batches
  config = TrainConfig(model="gemma3-270m", lora_rank=16, batch_size=8, seq_len=320, kl_weight=1.0)
  assert plan_for(config.replace(kl_weight=0.0)).total < 12.5 * 1024**3
  assert plan_for(config).total > 22 * 1024**3 > plan_for(config.replace(grad_accum=2)).total


def test_the_planned_kl_covers_what_xla_allocates_for_it():
  """XLA's buffer assignment of the gradient of the real SFT and SFT + KL losses (a tied embedding as the model):
  the KL's temporaries beyond the SFT loss's stay within the plan's KL_LOGIT_COPIES logit-sized tensors."""
  b, length, vocab, dim = 2, 64, 8192, 32
  params = {"emb": jax.ShapeDtypeStruct((vocab, dim), jnp.float32)}
  tokens = jax.ShapeDtypeStruct((b, length), jnp.int32)

  def apply(p, tokens, positions, mask):
    return types.SimpleNamespace(logits=(p["emb"][tokens] * 1.0) @ p["emb"].T)

  def batch(t):
    return types.SimpleNamespace(tokens=t, positions=t, targets=t, thread=t % 2, loss_mask=t > 0,
                                 thread_mask=lambda: None)

  def temp_bytes(loss):
    step = jax.jit(jax.grad(lambda p, r, t: loss(p, r, batch(t))[0]))
    return step.lower(params, params, tokens).compile().memory_analysis().temp_size_in_bytes

  sft = temp_bytes(lambda p, r, x: sft_loss_sum(apply, p, x))
  tags_of_pasta = KlTags(tuple(range(vocab - 100, vocab)), (vocab - 100,), (vocab - 99,), (vocab - 98,))
  for tags, kl_tags in ((False, NO_TAGS), (True, tags_of_pasta)):
    kl = temp_bytes(lambda p, r, x, t=kl_tags: sft_kl_loss_sum(apply, apply, p, r, x, 1.0, t))
    logits = b * length * vocab * 4
    assert kl - sft <= KL_LOGIT_COPIES[tags] * logits * 1.05, (tags, (kl - sft) / logits)


def test_plan_checks_the_hardware():
  with pytest.raises(ConfigError, match="v4-8 has 4 chips"):
    memory_plan(tiny_config(hardware="v4-8", mesh=MeshConfig(1, 2, 1)), TINY)
  with pytest.raises(ConfigError, match="unknown hardware 'v9'"):
    memory_plan(tiny_config(hardware="v9"), TINY)
  assert peak_flops_per_device("v5p-8") == 459e12
  assert peak_flops_per_device("h100x8", "float32") == 494.7e12


class FakeDevice:
  def __init__(self, platform, device_kind):
    self.platform, self.device_kind = platform, device_kind


@pytest.mark.parametrize("platform, kind, count, want", [
    ("cpu", "cpu", 8, "cpu"),
    ("gpu", "NVIDIA H100 80GB HBM3", 1, "h100x1"),
    ("gpu", "NVIDIA H100 80GB HBM3", 8, "h100x8"),
    ("gpu", "NVIDIA H200", 1, "h200x1"),
    ("tpu", "TPU v5 lite", 4, "v5e-4"),
    ("tpu", "TPU v5", 4, "v5p-8"),  # "TPU v5" must not read as v5e
    ("tpu", "TPU v4", 4, "v4-8"),
    ("tpu", "TPU v6 lite", 8, "v6e-8"),
    ("gpu", "NVIDIA H100 80GB HBM3", 2, None),  # no 2-chip entry: no peak to divide by
    ("gpu", "NVIDIA A100-SXM4-40GB", 1, None),
])
def test_detect_hardware_names_the_entry_of_the_chips_at_hand(platform, kind, count, want):
  assert detect_hardware([FakeDevice(platform, kind)] * count) == want


def test_training_defaults_to_the_hardware_at_hand(monkeypatch):
  import argparse

  from pasta_jax.training import plan
  from train.common import add_config_flags, train_config
  parser = argparse.ArgumentParser()
  add_config_flags(parser)
  assert train_config(parser.parse_args(["--out", "x"]), 1).hardware == "cpu"
  monkeypatch.setattr(plan, "detect_hardware", lambda: "h200x1")  # as on the lent H200
  assert train_config(parser.parse_args(["--out", "x"]), 1).hardware == "h200x1"
  assert train_config(parser.parse_args(["--out", "x", "--hardware", "v4-8"]), 1).hardware == "v4-8"
  monkeypatch.setattr(plan, "detect_hardware", lambda: None)  # chips with no entry: named as before, MFU nan
  assert train_config(parser.parse_args(["--out", "x"]), 1).hardware == "cpu"


def test_check_fits_refuses_with_the_plan():
  config = load_train_config(CONFIG_DIR / "gemma7b_sft_h100x1.json", param_dtype="float32", mu_dtype="float32",
                             lora_rank=0)
  with pytest.raises(ConfigError) as refused:
    check_fits(config, PRESETS["gemma1-7b"])
  first, *table = str(refused.value).splitlines()
  assert first.startswith("does not fit: training needs") and "h100x1" in first and "raise grad_accum" in first
  assert "DOES NOT FIT" in table[-1] and any(line.strip().startswith("parameters (float32)") for line in table)


def test_format_plan_lists_every_line():
  text = format_plan(plan_for(tiny_config(objective="bonbon")))
  for label in ("parameters", "gradients", "optimizer (mu float32, nu float32) + update", "activations", "batch",
                "total", "reference total", "usable", "headroom"):
    assert label in text


def test_model_resolution(tmp_path):
  from pasta_jax.model.weights import config_to_hf
  (tmp_path / "config.json").write_text(json.dumps(config_to_hf(TINY)))
  resolved = resolve_model_config(str(tmp_path))
  assert (resolved.num_layers, resolved.embed_dim, resolved.vocab_size) == (3, 64, 512)
  with pytest.raises(ConfigError, match="neither a preset"):
    resolve_model_config("gemma-9000")


# ------------------------------------------------------------------------------------------------ CLI


def write_config(tmp_path, **fields) -> str:
  path = tmp_path / "config.json"
  path.write_text(json.dumps({"comment": "test", **fields}))
  return str(path)


def test_cli_exit_codes(tmp_path, capsys):
  fits = write_config(tmp_path, model="tiny-gemma3", hardware="cpu", batch_size=4, seq_len=32)
  assert main(["plan", fits]) == 0
  assert "fits" in capsys.readouterr().out

  assert main(["plan", str(CONFIG_DIR / "gemma7b_sft_v5e-16.json"), "--seq-len", "16384"]) == 1
  out, err = capsys.readouterr()
  assert "DOES NOT FIT" in out
  assert err.strip().count("\n") == 0 and "does not fit" in err

  assert main(["plan", fits, "--mesh", "1,1,3"]) == 2
  assert "does not divide" in capsys.readouterr().err


def test_unknown_field_is_refused_naming_it(tmp_path, capsys):
  path = write_config(tmp_path, model="tiny-gemma3", hardware="cpu", batchsize=4)
  with pytest.raises(ConfigError, match="batchsize"):
    load_train_config(path)
  assert main(["plan", path]) == 2
  err = capsys.readouterr().err
  assert err.startswith("pasta: error:") and "batchsize" in err


def test_an_adapter_run_trains_only_the_adapter():
  """With lora_rank > 0 the frozen base is parameters only; gradients and moments are the adapter's (LoRA factors
  on the targets, the nominal embedding rows), whose elements the plan counts exactly."""
  from pasta_jax.model import lora
  from pasta_jax.training.plan import ADAPTER_ROWS
  full = memory_plan(tiny_config(), TINY)
  adapted = memory_plan(tiny_config(lora_rank=4, lora_targets=("q", "v")), TINY)
  base = jax.eval_shape(Gemma(TINY).init, jax.random.key(1), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32),
                        causal_mask(1, 4))
  adapter = jax.eval_shape(lambda p: lora.init_adapter(p, lora.AdapterConfig(4, 16.0, ("q", "v"), tuple(
      range(ADAPTER_ROWS))), jax.random.key(0)), base)
  assert adapted.adapter_params == elements(jax.tree.leaves(adapter)) and full.adapter_params == 0
  assert adapted.grads == 4 * adapted.adapter_params  # float32
  assert adapted.params == full.params + adapted.grads
  assert adapted.optimizer < full.optimizer / 4
