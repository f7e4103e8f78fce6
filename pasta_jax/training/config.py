"""Static training configuration (frozen dataclasses), read from and written to JSON.

One `TrainConfig` describes a whole job: the model, the mesh it is sharded over, the batch, the
optimizer schedule, precision and checkpointing. `tpu_configs/*.json` are files of this shape; the
memory planner (`training/plan.py`) reads the same object.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from pasta_jax.errors import ConfigError
from pasta_jax.model import runfiles
from pasta_jax.model.mesh import MeshConfig

Objective = Literal["sft", "baseline_sft", "apar_sft", "scoped_sft", "bonbon"]
SFT_OBJECTIVES = ("sft", "baseline_sft", "apar_sft", "scoped_sft")  # one answer an example, its token NLL
PASTA_OBJECTIVES = ("sft", "bonbon")  # objectives whose model writes PASTA tags

# Fields that say how a job runs, not what it trains: a resumed run may change them (another machine, mesh or
# kernel; saving or logging more often; the same global batch in other micro-batches). Any other field changed
# on resume is refused (TrainCheckpoints), since the restored state and the rest of the run would disagree.
RUN_ONLY_FIELDS = ("mesh", "hardware", "remat", "attention", "grad_accum", "save_every", "keep_checkpoints",
                   "log_every")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training job. Defaults are the paper's SFT settings (batch 8, lr 1e-5 linear to 0, 4 epochs)."""

  model: str = "gemma3-270m"  # preset name, HF folder, .gguf file or Orbax checkpoint
  objective: Objective = "sft"
  mesh: MeshConfig = MeshConfig()
  hardware: str = "cpu"  # key of plan.HARDWARE: chip memory for the plan
  batch_size: int = 8  # global examples per optimizer step
  grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
  seq_len: int = 1024  # tokens per example, prompt + laid-out answer (longer examples are refused)
  length_bucket: int = 0  # > 0: examples of like length batched together, padded to a multiple of this
  num_threads: int = 16  # horizon columns per example (main + forks)
  epochs: int = 4
  max_steps: int = 0  # > 0 caps the number of optimizer steps
  learning_rate: float = 1e-5
  end_learning_rate: float = 0.0
  warmup_steps: int = 0
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  grad_clip: float = 1.0
  compute_dtype: str = "float32"  # "bfloat16" on accelerators
  param_dtype: str = "float32"  # master weights
  mu_dtype: str = "float32"  # Adam first moment (bfloat16 halves it; the second moment stays float32)
  remat: bool = False
  position_mode: str = "pred"
  bonbon_alpha: float = 0.005
  bonbon_beta: float = 0.1
  seed: int = 0
  save_every: int = 100
  keep_checkpoints: int = 2
  log_every: int = 1
  # Adapters (lora_rank > 0): the base stays frozen and only LoRA factors and embedding rows train.
  lora_rank: int = 0  # 0: full fine-tuning
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("q", "k", "v", "o")  # the earlier paper's choice (rank 16, alpha 16)
  train_rows: tuple[str, ...] = ("tags", "chat")  # embedder rows that train with an adapter
  kl_weight: float = 0.0  # the earlier paper's KL(tuned || base) on answer tokens (it used 0.2)
  kl_reference: str = ""  # an adapter (folder or shipped name, e.g. baseline-sft) the KL pulls toward; "": the base
  attention: str = "xla"  # "xla" or "pallas": the attention kernel over the thread metadata (model/thread_attention.py)

  def __post_init__(self):
    problems = []
    if self.length_bucket < 0 or self.length_bucket > self.seq_len:
      problems.append(f"length_bucket={self.length_bucket}; use 0 (every batch padded to seq_len) or a bucket in "
                      f"(0, seq_len={self.seq_len}]")
    if self.lora_rank < 0:
      problems.append(f"lora_rank={self.lora_rank}; use 0 (full fine-tuning) or a positive rank")
    if self.kl_weight and not self.lora_rank:
      problems.append("kl_weight needs an adapter run (lora_rank > 0): the frozen base is the KL's reference")
    if self.kl_reference and self.kl_weight <= 0:
      problems.append(f"kl_reference={self.kl_reference!r} does nothing with kl_weight={self.kl_weight}; give both")
    unknown_rows = sorted(set(self.train_rows) - {"tags", "chat"})
    if unknown_rows:
      problems.append(f"unknown train_rows {unknown_rows}; use tags and/or chat")
    if self.batch_size % self.grad_accum:
      problems.append(f"batch_size={self.batch_size} is not a multiple of grad_accum={self.grad_accum}")
    micro = self.batch_size // max(self.grad_accum, 1)
    replicas = self.mesh.data * self.mesh.fsdp
    if micro % replicas:
      problems.append(f"the micro-batch of {micro} examples (batch_size / grad_accum) does not divide over "
                      f"data x fsdp = {self.mesh.data} x {self.mesh.fsdp} = {replicas} devices")
    if self.objective not in (*SFT_OBJECTIVES, "bonbon"):
      problems.append(f"unknown objective {self.objective!r}; use sft, baseline_sft, apar_sft, scoped_sft or bonbon")
    if self.attention not in ("xla", "pallas", "pallas-tpu", "pallas-gpu"):
      problems.append(f"attention={self.attention!r}; use xla or pallas")
    for name in ("compute_dtype", "param_dtype", "mu_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        problems.append(f"{name}={getattr(self, name)!r}; use float32 or bfloat16")
    if min(self.mesh.data, self.mesh.fsdp, self.mesh.tensor) < 1:
      problems.append(f"mesh axes must be >= 1, got {self.mesh.shape}")
    if problems:
      raise ConfigError("invalid training config: " + "; ".join(problems))

  @property
  def micro_batch(self) -> int:
    return self.batch_size // self.grad_accum

  @property
  def with_kl(self) -> bool:
    """Whether the loss carries the KL term: an SFT objective with kl_weight > 0 (BoNBoN has its own reference)."""
    return self.objective in SFT_OBJECTIVES and self.kl_weight > 0

  @property
  def writes_tags(self) -> bool:
    """Whether the trained model writes PASTA tags (the KL then leaves them out, `losses.sft_kl_loss_sum`)."""
    return self.objective in PASTA_OBJECTIVES

  def replace(self, **changes) -> TrainConfig:
    if "mesh" in changes and isinstance(changes["mesh"], dict):
      changes["mesh"] = MeshConfig(**changes["mesh"])
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> TrainConfig:
    fields = dict(fields)
    fields.pop("comment", None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ConfigError(f"unknown training config fields {unknown}; known: {sorted(known)}")
    if isinstance(fields.get("mesh"), dict):
      mesh_known = {f.name for f in dataclasses.fields(MeshConfig)}
      bad = sorted(set(fields["mesh"]) - mesh_known)
      if bad:
        raise ConfigError(f"unknown mesh axes {bad}; use data, fsdp, tensor")
      fields["mesh"] = MeshConfig(**fields["mesh"])
    for name in ("lora_targets", "train_rows"):  # JSON lists back to tuples (the dataclass is hashable)
      if name in fields:
        fields[name] = tuple(fields[name])
    return cls(**fields)


def load_train_config(path: str | os.PathLike, **overrides) -> TrainConfig:
  """A TrainConfig from a JSON file (tpu_configs/*.json), with keyword overrides."""
  if not os.path.isfile(path):
    raise ConfigError(f"training config {str(path)!r} does not exist")
  fields = runfiles.read_json_file(path, ConfigError)
  fields.update({k: v for k, v in overrides.items() if v is not None})
  return TrainConfig.from_dict(fields)
