"""Per-chip memory plan of sharded decoding, from abstract shapes only (no weight is materialized).

A decode config (JSON, `"kind": "decode"`, in tpu_configs/) names the model, dtype, hardware, mesh,
batch, lanes (parallel threads per request), pool slots and prompt length. Counted per chip, with the
placements of `decode/sharding.py` (the trainer's logical-axis rules):

  weights      every parameter in `dtype`, divided by the mesh axes its dimensions split over
               (a replicated dimension, such as an unsplittable KV head, counts fully on every chip).
  pool         K and V, [layers, B, S, K, head_dim] in `dtype`: B over data x fsdp when it divides them,
               KV heads over tensor when they divide it, else replicated.
  prefill      the largest step: the prompt's attention scores [B, H, P, S] in float32 (heads over
               tensor), its MLP hidden [B, P, F] (F over tensor), residual stream and norms, and the
               logits of every prompt position [B, P, V] in float32 (the model call returns them all;
               prefill keeps the last: usually the largest term after weights and pool).
  decode step  the same for Q = lanes rows per request (and the [B, Q, V] float32 logits, vocabulary
               over tensor); prefill and decode steps never overlap, so the larger one counts.
  state        the thread table, slot metadata and records (int32), replicated over tensor.

A plan fits under `USABLE_FRACTION` of a chip, as training plans do.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from pasta_jax.errors import ConfigError
from pasta_jax.training.plan import (
  GIB,
  USABLE_FRACTION,
  _shard_factors,
  _with_dtype,
  abstract_params,
  get_hardware,
  resolve_model_config,
  sharded_bytes,
)

RECORD_COLUMNS = 5


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  model: str
  hardware: str
  mesh: dict  # data, fsdp, tensor
  batch: int = 1
  lanes: int = 8
  pool_slots: int = 4096
  prompt_len: int = 1024
  dtype: str = "bfloat16"
  comment: str = ""

  def __post_init__(self):
    if set(self.mesh) != {"data", "fsdp", "tensor"}:
      raise ConfigError(f"decode config mesh needs data, fsdp and tensor, got {sorted(self.mesh)}")
    if min(self.batch, self.lanes, self.pool_slots, self.prompt_len) < 1 or self.prompt_len > self.pool_slots:
      raise ConfigError(f"decode config needs positive batch, lanes, pool_slots and prompt_len <= pool_slots: {self}")


def load_decode_config(path: str | Path) -> DecodeConfig:
  raw = json.loads(Path(path).read_text())
  raw.pop("kind", None)
  try:
    return DecodeConfig(**raw)
  except TypeError as err:
    raise ConfigError(f"{path}: {err}") from None


def is_decode_config(path: str | Path) -> bool:
  try:
    return json.loads(Path(path).read_text()).get("kind") == "decode"
  except (OSError, ValueError):
    return False


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  config: DecodeConfig
  param_count: int
  parts: tuple[tuple[str, int], ...]  # (what, bytes per chip)
  capacity: int

  @property
  def total(self) -> int:
    return sum(n for _, n in self.parts)

  @property
  def usable(self) -> int:
    return int(self.capacity * USABLE_FRACTION)

  @property
  def fits(self) -> bool:
    return self.total <= self.usable

  def reason(self) -> str:
    return "" if self.fits else (f"decoding needs {self.total / GIB:.2f} GiB per chip, over the "
                                 f"{self.usable / GIB:.2f} GiB usable on {self.config.hardware}")


def pool_bytes(cfg, batch: int, slots: int, dtype: str, mesh: dict) -> int:
  """K and V of the pool on one chip (decode/sharding.py's placement)."""
  batch_split = mesh["data"] * mesh["fsdp"]
  per_request = batch // batch_split if batch % batch_split == 0 else batch
  kv = cfg.num_kv_heads // mesh["tensor"] if cfg.num_kv_heads % mesh["tensor"] == 0 else cfg.num_kv_heads
  return 2 * cfg.num_layers * per_request * slots * kv * cfg.head_dim * jnp.dtype(dtype).itemsize


def _step_bytes(cfg, rows: int, keys: int, tensor: int, logit_rows: int) -> int:
  """One forward's largest live activations for `rows` query rows over `keys` keys (per chip)."""
  f32 = 4
  scores = rows * (cfg.num_heads // tensor) * keys * f32
  hidden = rows * (cfg.hidden_dim // tensor) * f32 * 2  # gate and up
  resid = rows * cfg.embed_dim * f32 * 3
  logits = logit_rows * (cfg.vocab_size // tensor) * f32
  return scores + hidden + resid + logits


def decode_plan(config: DecodeConfig) -> DecodePlan:
  cfg = resolve_model_config(config.model)
  mesh, tensor = config.mesh, config.mesh["tensor"]
  hardware = get_hardware(config.hardware)
  chips = mesh["data"] * mesh["fsdp"] * tensor
  if hardware.chips is not None and chips != hardware.chips:
    raise ConfigError(f"mesh data x fsdp x tensor = {chips} chips, but {config.hardware} has {hardware.chips}")
  if cfg.num_heads % tensor or cfg.vocab_size % tensor or cfg.hidden_dim % tensor:
    raise ConfigError(f"{config.model}: heads {cfg.num_heads}, MLP {cfg.hidden_dim} and vocabulary "
                      f"{cfg.vocab_size} must divide tensor={tensor}")
  params = _with_dtype(abstract_params(cfg)["params"], config.dtype)
  weights = sharded_bytes(params, _shard_factors(params, mesh))
  batch_split = mesh["data"] * mesh["fsdp"]
  per_chip_batch = config.batch // batch_split if config.batch % batch_split == 0 else config.batch
  # The model call returns logits for every prompt row (prefill keeps the last): [B, P, V] f32 live at once.
  prefill = _step_bytes(cfg, per_chip_batch * config.prompt_len, config.pool_slots, tensor,
                        per_chip_batch * config.prompt_len)
  step = _step_bytes(cfg, per_chip_batch * config.lanes, config.pool_slots, tensor, per_chip_batch * config.lanes)
  records = config.pool_slots + config.lanes + 1
  state = per_chip_batch * (records * RECORD_COLUMNS + 4 * config.pool_slots + 64 * config.lanes) * 4
  parts = (("weights", weights), ("KV pool", pool_bytes(cfg, config.batch, config.pool_slots, config.dtype, mesh)),
           (f"activations (the larger of prefill, {prefill / GIB:.2f} GiB, and a step)", max(prefill, step)),
           ("thread table, slots, records", state))
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  return DecodePlan(config, count, parts, hardware.memory_bytes)


def format_decode_plan(plan: DecodePlan) -> str:
  c = plan.config
  lines = [f"decode memory plan: {c.model} ({plan.param_count / 1e9:.2f}B params) in {c.dtype} on {c.hardware}, "
           f"mesh data={c.mesh['data']} fsdp={c.mesh['fsdp']} tensor={c.mesh['tensor']}",
           f"  batch {c.batch} x {c.lanes} lanes, pool {c.pool_slots} slots per request, prompts up to "
           f"{c.prompt_len} tokens", "", f"  {'per chip':<60}{'GiB':>9}"]
  lines += [f"  {label:<60}{n / GIB:>9.2f}" for label, n in plan.parts]
  verdict = "fits" if plan.fits else "DOES NOT FIT"
  lines += [f"  {'total':<60}{plan.total / GIB:>9.2f}", "",
            f"  {f'usable ({USABLE_FRACTION:.0%} of {plan.capacity / GIB:.2f} GiB)':<60}{plan.usable / GIB:>9.2f}",
            f"  {'headroom':<60}{(plan.usable - plan.total) / GIB:>9.2f}   {verdict}"]
  return "\n".join(lines)
