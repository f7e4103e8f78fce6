"""Per-device memory plan of a training job, from abstract shapes only (no weight is ever materialized).

The trainer calls `check_fits` before it allocates anything; `pasta plan CONFIG` prints the same table.
What is counted, per device:

  parameters   master weights in param_dtype, sharded by `partitioning.param_specs` (a replicated
               dimension counts fully, so norm scales and unsplittable KV heads cost every device).
  gradients    the gradient tree of what trains, param_dtype, sharded like the parameters.
  optimizer    the real optax state of `optimizer.make_optimizer` (eval_shape of its init), moments
               sharded like their parameters, scalars replicated; plus the update's working set: the
               largest trainable leaf's new moments in float32 (two copies of this device's shard). On an
               H100, Gemma 7B full fine-tuning in bfloat16 (tpu_configs/gemma7b_sft_h100x1.json as it was)
               needed 27.65 GiB of XLA temporaries beside 47.7 GiB of parameters and moments: 5.4 GiB more
               than gradients + activations, about two float32 copies of the 256k x 3072 embedding (5.9).
  adapters     with lora_rank > 0 only the adapter trains (LoRA factors, ADAPTER_ROWS nominal embedding
               rows): the frozen base counts as parameters, gradients and moments are the adapter's.
  activations  an estimate for one micro-batch (batch_size / grad_accum examples; BoNBoN forwards the
               chosen and the rejected answer of each pair, so two sequences per example), see
               `_activation_parts`: the layer inputs kept for the backward pass (remat) or every
               layer's saved tensors (no remat: attention scores [b, h, L, L] in f32, MLP hidden, ...),
               plus the working set of one layer's backward, plus the head: logits [b, L, V] f32 and
               their gradient, the embedding gathered in compute dtype and its unsharded gradient.
               Summing the head and the layer working set overcounts a little (they are not alive at
               the same instant): the estimate is meant to err on the safe side.
               With the SFT KL term (kl_weight > 0), also the reference's forward and the KL's logit-sized
               tensors (`KL_LOGIT_COPIES`): at batch 8 x 320 tokens on the 270M that is 12.5 GiB, more than the
               rest of the step together.
  batch        this device's slice of the whole global batch (every micro-batch is placed at once).

Activations are split over `tensor` where their dimension is (heads, MLP width, vocabulary), and over
data x fsdp by examples; the residual stream [b, L, D] is replicated over `tensor`. A plan fits when
the total stays under `USABLE_FRACTION` of the chip's memory: the rest is left to XLA's scratch
buffers, fragmentation, the optimizer update's temporaries and the error of this estimate.

Checked against XLA's own buffer assignment of the real train step (`compile().memory_analysis()`,
CPU backend, float32, no remat): gemma3-270m b=2 L=1024 plan 10.7 GiB vs XLA 10.4; gemma1-2b b=2
L=512 plan 21.8 vs 18.8; fsdp=4 (4 simulated devices) plan 6.5 vs 5.7 -- but only once the residual
stream and the logits carry batch sharding constraints: without them GSPMD all-gathered the batch
instead of the weights (13.0 GiB, logits of the whole micro-batch on every device). The CPU backend
ignores remat (same memory with and without), so the remat estimate is unchecked there.

For BoNBoN the reference log-probs are computed once before training (params in compute dtype plus a
forward pass, no training state resident); that pass is planned on its own line and must fit too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from pasta_jax.errors import ConfigError
from pasta_jax.model.config import PRESETS, GemmaConfig
from pasta_jax.model.partitioning import param_specs
from pasta_jax.training.config import TrainConfig

GIB = 1024**3
USABLE_FRACTION = 0.90  # of a chip's memory; see the module docstring
# The KL term's [b, L, V] f32 tensors beyond the SFT loss's own (the reference's logits, both log-softmaxes, the
# terms kept for the backward), as XLA's buffer assignment counts them for `losses.sft_kl_loss_sum`: 3 over the
# whole vocabulary, 5 when the tags are left out (their masked copies of both logits).
KL_LOGIT_COPIES = {False: 3, True: 5}
ADAPTER_ROWS = 64  # embedding rows an adapter trains, nominal (tag and chat-turn tokens: the tokenizer decides)
BATCH_INT32_FIELDS = 5  # tokens, positions, thread, order, targets [B, L]; plus valid, loss_mask (bool)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """A training target: chips, memory per chip and peak dense matmul FLOP/s per chip."""

  name: str
  chips: int | None  # None: any number of (simulated) devices sharing the host
  memory_bytes: int  # per chip (host memory for `cpu`)
  peak_bf16_flops: float
  peak_f32_flops: float  # what a float32 matmul gets at JAX's default precision
  description: str


def _host_memory_bytes() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return 16 * GIB


def _cpu_peak_flops() -> float:
  # Rough: ~50 GFLOP/s per core (AVX2/AVX-512 FMA in f32 at typical clocks); MFU on CPU is only indicative.
  return 50e9 * (os.cpu_count() or 1)


# Peak figures are dense (no sparsity) per chip.
# TPU: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e): v4 275 TFLOP/s
#   bf16, 32 GiB HBM2; v5e 197 TFLOP/s, 16 GB HBM2; v5p 459 TFLOP/s, 95 GB HBM2e; v6e (Trillium) 918 TFLOP/s,
#   32 GB HBM. A float32 matmul runs at the bf16 rate on TPU (JAX's default precision rounds its inputs to
#   bf16: docs.jax.dev/en/latest/201/precision.html), so its peak is the same.
# H100 SXM: NVIDIA H100 datasheet, BF16 tensor core 1979 TFLOP/s *with sparsity*, i.e. 989.4 dense; TF32
#   (JAX's default for float32 matmuls on Hopper) 494.7 dense. 80 GB HBM3, which nvidia-smi reports as 81559 MiB.
# H200: the same tensor-core peaks (NVIDIA H200 datasheet), 141 GB HBM3e, which nvidia-smi reports as 143771 MiB.
HARDWARE: dict[str, Hardware] = {
    "cpu": Hardware("cpu", None, _host_memory_bytes(), _cpu_peak_flops(), _cpu_peak_flops(),
                    "this host (simulated devices share its memory and cores)"),
    "v4-8": Hardware("v4-8", 4, 32 * GIB, 275e12, 275e12, "TPU v4, 4 chips (8 TensorCores), 1 host"),
    "v5e-1": Hardware("v5e-1", 1, 16 * GIB, 197e12, 197e12, "TPU v5e (v5litepod-1), 1 chip"),
    "v5e-4": Hardware("v5e-4", 4, 16 * GIB, 197e12, 197e12, "TPU v5e (v5litepod-4), 4 chips, 1 host"),
    "v5e-8": Hardware("v5e-8", 8, 16 * GIB, 197e12, 197e12, "TPU v5e (v5litepod-8), 8 chips, 1 host"),
    "v5e-16": Hardware("v5e-16", 16, 16 * GIB, 197e12, 197e12, "TPU v5e (v5litepod-16), 16 chips, 4 hosts"),
    "v5p-8": Hardware("v5p-8", 4, 95 * GIB, 459e12, 459e12, "TPU v5p, 4 chips (8 TensorCores), 1 host"),
    "v6e-4": Hardware("v6e-4", 4, 32 * GIB, 918e12, 918e12, "TPU v6e (Trillium), 4 chips, 1 host"),
    "v6e-8": Hardware("v6e-8", 8, 32 * GIB, 918e12, 918e12, "TPU v6e (Trillium), 8 chips, 1 host"),
    "h100x1": Hardware("h100x1", 1, 81559 * 1024**2, 989.4e12, 494.7e12, "1 NVIDIA H100 SXM 80GB"),
    "h100x8": Hardware("h100x8", 8, 81559 * 1024**2, 989.4e12, 494.7e12, "8 NVIDIA H100 SXM 80GB, 1 host"),
    "h200x1": Hardware("h200x1", 1, 143771 * 1024**2, 989.4e12, 494.7e12, "1 NVIDIA H200 141GB"),
}

# device_kind (what jax reports) -> the chip family the HARDWARE descriptions name; longest match first
_FAMILIES = (("TPU v5 lite", "TPU v5e"), ("TPU v6 lite", "TPU v6e"), ("TPU v5", "TPU v5p"), ("TPU v4", "TPU v4"),
             ("H100", "NVIDIA H100"), ("H200", "NVIDIA H200"))


def detect_hardware(devices=None) -> str | None:
  """The HARDWARE key of `devices` (default: every device this process sees): "cpu" on the CPU backend, else the
  entry naming their chip family with as many chips; None when no entry does (an MFU would then be made up)."""
  devices = jax.devices() if devices is None else devices
  if devices[0].platform == "cpu":
    return "cpu"
  family = next((name for kind, name in _FAMILIES if kind in devices[0].device_kind), None)
  if family is None:
    return None
  return next((key for key, hw in HARDWARE.items() if hw.chips == len(devices) and family in hw.description), None)


def get_hardware(name: str) -> Hardware:
  if name not in HARDWARE:
    raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
  return HARDWARE[name]


def peak_flops_per_device(hardware: str, dtype: str = "bfloat16") -> float:
  """Peak dense matmul FLOP/s of one device (the MFU denominator). On `cpu` the host's peak is split
  over its (possibly simulated) devices."""
  target = get_hardware(hardware)
  peak = target.peak_f32_flops if jnp.dtype(dtype) == jnp.float32 else target.peak_bf16_flops
  if target.chips is None:
    peak /= max(jax.local_device_count(), 1)
  return peak


def resolve_model_config(model: str) -> GemmaConfig:
  """The GemmaConfig of a preset name, a pasta checkpoint folder or a Hugging Face folder (config only)."""
  if model in PRESETS:
    return PRESETS[model]
  path = Path(model)
  if (path / "pasta_config.json").is_file():
    from pasta_jax.model.checkpoint import load_checkpoint_config
    return load_checkpoint_config(path)
  if (path / "config.json").is_file():
    from pasta_jax.model.weights import config_from_hf, read_hf_config
    try:
      return config_from_hf(read_hf_config(path), name=path.name)
    except (KeyError, ValueError) as err:
      raise ConfigError(f"cannot read a Gemma config from {path / 'config.json'}: {err}") from None
  raise ConfigError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a folder with "
                    "config.json or pasta_config.json")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device. `parts` lists the activation estimate line by line; `reference_parts` the
  BoNBoN reference pass (empty for other objectives)."""

  model: str
  param_count: int
  objective: str
  hardware: str
  mesh: dict[str, int]
  dtypes: dict[str, str]  # compute, param, optimizer state leaves (e.g. "mu float32, nu float32")
  micro_batch: int  # global examples per micro-batch
  sequences_per_device: int  # sequences in one device's slice of a micro-batch
  seq_len: int
  grad_accum: int
  remat: bool
  params: int
  grads: int
  adapter_params: int  # elements that train with lora_rank > 0 (0: full fine-tuning)
  optimizer: int
  activations: int
  batch: int
  parts: tuple[tuple[str, int], ...]
  reference: int  # the BoNBoN reference pass total (0: none)
  reference_parts: tuple[tuple[str, int], ...]
  capacity: int  # memory of one device
  usable: int  # capacity x USABLE_FRACTION

  @property
  def total(self) -> int:
    return self.params + self.grads + self.optimizer + self.activations + self.batch

  @property
  def peak(self) -> int:
    """The larger of training and the reference pass (they never share the device)."""
    return max(self.total, self.reference)

  @property
  def headroom(self) -> int:
    return self.usable - self.peak

  @property
  def fits(self) -> bool:
    return self.peak <= self.usable

  def reason(self) -> str:
    """One line: why it does not fit (empty when it does)."""
    if self.fits:
      return ""
    what = "training" if self.total >= self.reference else "the BoNBoN reference pass"
    remedy = "; raise grad_accum (fewer examples a micro-batch) or lower seq_len" if what == "training" else ""
    return (f"{what} needs {_gib(self.peak)} GiB per device, over the {_gib(self.usable)} GiB usable "
            f"({USABLE_FRACTION:.0%} of {_gib(self.capacity)} GiB) on {self.hardware}{remedy}")


# ---------------------------------------------------------------------------------------------- shapes


@functools.lru_cache(maxsize=16)
def abstract_params(model_config: GemmaConfig) -> dict:
  """{'params': tree} of jax.ShapeDtypeStruct (float32) from an abstract init with dummy inputs."""
  from pasta_jax.model.gemma import Gemma
  tokens = jnp.zeros((1, 1), jnp.int32)
  mask = jnp.ones((1, 1, 1), bool)
  return jax.eval_shape(lambda: Gemma(model_config).init(jax.random.key(0), tokens, tokens, mask))


def _adapter(train_config: TrainConfig, params) -> dict:
  """The abstract adapter tree an adapter run trains (in param_dtype), for the base `params`."""
  from pasta_jax.model import lora
  config = lora.AdapterConfig(train_config.lora_rank, train_config.lora_alpha, tuple(train_config.lora_targets),
                              tuple(range(ADAPTER_ROWS)))
  return _with_dtype(jax.eval_shape(lambda p: lora.init_adapter(p, config, jax.random.key(0)), params),
                     train_config.param_dtype)


def _update_working_set(trainable, factors) -> int:
  """Two float32 copies of the largest trainable leaf's shard: what the moment update holds at once."""
  shards = jax.tree.leaves(jax.tree.map(lambda leaf, f: _elements(leaf) // f, trainable, factors))
  return 2 * 4 * max(shards)


def _elements(tree) -> int:
  return sum(int(np.prod(leaf.shape, dtype=np.int64)) for leaf in jax.tree.leaves(tree))


def _with_dtype(tree, dtype) -> dict:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), tree)


def _axis_size(mesh_shape: dict[str, int], axis) -> int:
  if axis is None:
    return 1
  names = (axis,) if isinstance(axis, str) else axis
  return int(np.prod([mesh_shape[a] for a in names]))


def _shard_factors(params, mesh_shape: dict[str, int]) -> dict:
  """Per leaf: by how much the mesh divides it (1 = fully replicated). Raises ConfigError from
  `param_specs` when a dimension does not divide its mesh axis."""
  specs = param_specs(params, mesh_shape)
  return jax.tree.map(lambda spec: int(np.prod([_axis_size(mesh_shape, a) for a in spec] or [1])), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def _nbytes(leaf) -> int:
  return int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize


def sharded_bytes(tree, factors) -> int:
  """Bytes one device holds of `tree`, each leaf divided by its shard factor."""
  return sum(jax.tree.leaves(jax.tree.map(lambda leaf, f: _nbytes(leaf) // f, tree, factors)))


def _optimizer_state(train_config: TrainConfig, params):
  from pasta_jax.training.optimizer import make_optimizer
  optimizer = make_optimizer(train_config, total_steps=1)
  return optimizer, jax.eval_shape(optimizer.init, params)


def _optimizer_bytes(train_config: TrainConfig, params, factors) -> tuple[int, str]:
  """(bytes per device, the dtypes of its per-parameter trees, e.g. 'mu float32, nu float32')."""
  import optax
  optimizer, state = _optimizer_state(train_config, params)
  per_leaf = optax.tree_map_params(optimizer, lambda leaf, f: _nbytes(leaf) // f, state, factors,
                                   transform_non_params=_nbytes)
  return sum(jax.tree.leaves(per_leaf)), ", ".join(_moment_dtypes(state)) or "none"


def _moment_dtypes(node) -> list[str]:
  """'name dtype' of every named field of the optax state that holds a parameter-shaped tree."""
  fields = getattr(node, "_fields", None)
  if fields is not None:
    children = [(name, getattr(node, name)) for name in fields]
  elif isinstance(node, tuple | list):
    children = [(None, child) for child in node]
  else:
    return []
  found = []
  for name, child in children:
    if name is not None and isinstance(child, dict):
      found.append(f"{name} {jax.tree.leaves(child)[0].dtype}")
    else:
      found += _moment_dtypes(child)
  return found


# ------------------------------------------------------------------------------------------ activations


@dataclasses.dataclass(frozen=True)
class _Dims:
  """Per-device activation dimensions of one micro-batch."""

  b: int  # sequences
  L: int
  D: int
  heads: int  # query heads on this device (split over tensor)
  kv_heads: int  # KV heads on this device (replicated when they do not split)
  head_dim: int
  mlp: int
  vocab: int
  layers: int
  compute: int  # bytes of compute_dtype
  param: int  # bytes of param_dtype

  @property
  def resid(self) -> int:
    return self.b * self.L * self.D

  @property
  def scores(self) -> int:
    return self.b * self.heads * self.L * self.L


def sequences_per_example(objective: str) -> int:
  """BoNBoN forwards the chosen and the rejected answer of each pair; the SFT objectives one sequence."""
  return 2 if objective == "bonbon" else 1


def _dims(train_config: TrainConfig, cfg: GemmaConfig) -> _Dims:
  mesh = train_config.mesh
  tensor = mesh.tensor
  replicas = mesh.data * mesh.fsdp
  b = train_config.micro_batch // replicas * sequences_per_example(train_config.objective)
  kv_heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
  return _Dims(b=b, L=train_config.seq_len, D=cfg.embed_dim, heads=cfg.num_heads // tensor,
               kv_heads=kv_heads, head_dim=cfg.head_dim, mlp=cfg.hidden_dim // tensor,
               vocab=cfg.vocab_size // tensor, layers=cfg.num_layers,
               compute=jnp.dtype(train_config.compute_dtype).itemsize,
               param=jnp.dtype(train_config.param_dtype).itemsize)


def _layer_saved(d: _Dims, cfg: GemmaConfig) -> int:
  """Tensors one layer's forward keeps for its backward (all of them without remat; recomputed with it)."""
  c = d.compute
  norms = 2 + cfg.use_post_attn_norm + cfg.use_post_ffw_norm
  resid = d.resid * (3 * c + norms * (c + 4))  # input, attn projection, residual sum; each norm's output + f32 copy
  q_side = d.b * d.L * d.heads * d.head_dim * (3 * c + (c + 4) * cfg.use_qk_norm)  # q, rotated q, attn output
  kv_side = d.b * d.L * d.kv_heads * d.head_dim * (3 * c + (c + 4) * cfg.use_qk_norm)  # k, rotated k, v
  # Scores and probabilities in f32 and the probabilities in compute dtype (XLA keeps the pre-softmax
  # scores too more often than not), plus the soft-capped scores where the family caps them.
  scores = d.scores * (8 + c + 4 * (cfg.attn_logit_softcap is not None))
  mlp = d.b * d.L * d.mlp * 5 * c  # gate and up projections, GELU's tanh and output, their product
  return resid + q_side + kv_side + scores + mlp


def _layer_backward_temporaries(d: _Dims, cfg: GemmaConfig) -> int:
  """Gradients alive while one layer's backward runs: scores (f32), MLP hidden, residual, q/k/v."""
  c = d.compute
  qkv = d.b * d.L * d.head_dim * (d.heads + 2 * d.kv_heads)
  local_mask = d.b * d.L * d.L * 5 * ("local" in cfg.layer_kinds)  # window mask (bool) + distances (int32)
  return d.scores * 4 + d.b * d.L * d.mlp * 2 * c + d.resid * 2 * c + qkv * c + local_mask


def _gathered_copies(train_config: TrainConfig, prefetch: bool) -> int:
  """Full (fsdp-gathered, compute-dtype) copies of a weight alive while it is used: FSDP gathers it
  (and XLA prefetches the next one); without FSDP only a dtype cast makes a copy."""
  if train_config.mesh.fsdp > 1:
    return 2 if prefetch else 1
  return int(train_config.compute_dtype != train_config.param_dtype)


def _tensor_only_elements(tree, tensor: int) -> int:
  """Elements per device of `tree` gathered over fsdp but still split over tensor."""
  factors = _shard_factors(tree, {"data": 1, "fsdp": 1, "tensor": tensor})
  return sum(jax.tree.leaves(jax.tree.map(lambda leaf, f: int(np.prod(leaf.shape)) // f, tree, factors)))


def _weight_working_set(train_config: TrainConfig, d: _Dims, elements: int, prefetch: bool) -> int:
  """Gathered compute-dtype copies of a weight plus its unsharded gradient (param dtype) before the
  reduce-scatter."""
  return elements * (d.compute * _gathered_copies(train_config, prefetch) + d.param)


def _head(d: _Dims, cfg: GemmaConfig, train_config: TrainConfig, embed_elements: int, backward: bool) -> int:
  """Logits [b, L, V] f32 (+ gradient or the log-softmax's exponentials), final norm, tied embedding."""
  logits = d.b * d.L * d.vocab * 4 * (2 + (cfg.final_logit_softcap is not None))
  final_norm = d.resid * (2 * d.compute + 4)
  embedding = embed_elements * d.compute * _gathered_copies(train_config, prefetch=False)
  if backward:
    embedding += embed_elements * d.param
  return logits + final_norm + embedding


def _mask_bytes(d: _Dims) -> int:
  """The [b, L, L] bool mask built on device, and the int32 horizon gather it is made from."""
  return d.b * d.L * d.L * 5


def _activation_parts(train_config: TrainConfig, cfg: GemmaConfig, params) -> list[tuple[str, int]]:
  d = _dims(train_config, cfg)
  tree = params["params"]
  layer_elements = _tensor_only_elements(tree["layer_0"], train_config.mesh.tensor)
  embed_elements = _tensor_only_elements({"embedder": tree["embedder"]}, train_config.mesh.tensor)
  working = _layer_saved(d, cfg) * train_config.remat + _layer_backward_temporaries(d, cfg)
  working += _weight_working_set(train_config, d, layer_elements, prefetch=True)
  if train_config.remat:
    kept = ("layer inputs kept (remat)", d.layers * d.resid * d.compute)
  else:
    # Autodiff keeps the weights each matmul used: under FSDP, the gathered compute-dtype copies.
    gathered = layer_elements * d.compute * (train_config.mesh.fsdp > 1)
    kept = ("every layer's saved tensors (no remat)", d.layers * (_layer_saved(d, cfg) + gathered))
  return [kept, ("one layer's backward working set", working),
          ("logits, final norm, embedding", _head(d, cfg, train_config, embed_elements, backward=True)),
          ("attention mask", _mask_bytes(d)), *_kl_parts(train_config, d, cfg)]


def _kl_parts(train_config: TrainConfig, d: _Dims, cfg: GemmaConfig) -> list[tuple[str, int]]:
  """The KL term's reference forward (no gradient: one layer's tensors at a time) and its logit-sized tensors."""
  if not train_config.with_kl:
    return []
  logits = d.b * d.L * d.vocab * 4 * KL_LOGIT_COPIES[train_config.writes_tags]
  return [("KL: reference forward, its logits and the KL's terms", _layer_saved(d, cfg) + logits)]


def _batch_bytes(train_config: TrainConfig) -> int:
  """This device's share of the global batch: int32 fields, 2 bool fields, horizon [L, U] int32."""
  mesh = train_config.mesh
  examples = train_config.batch_size // (mesh.data * mesh.fsdp)
  per_token = BATCH_INT32_FIELDS * 4 + 2 + 4 * train_config.num_threads
  per_example = sequences_per_example(train_config.objective) * train_config.seq_len * per_token
  if train_config.objective == "bonbon":
    per_example += 2 * 4  # reference log-probs of chosen and rejected
  return examples * per_example


def _reference_parts(train_config: TrainConfig, cfg: GemmaConfig, params, factors) -> list[tuple[str, int]]:
  """The one-off BoNBoN reference pass: params in compute dtype and a forward without gradients."""
  if train_config.objective != "bonbon":
    return []
  d = _dims(train_config, cfg)
  tree = params["params"]
  compute_params = sharded_bytes(_with_dtype(params, train_config.compute_dtype), factors)
  layer_elements = _tensor_only_elements(tree["layer_0"], train_config.mesh.tensor)
  embed_elements = _tensor_only_elements({"embedder": tree["embedder"]}, train_config.mesh.tensor)
  gathered = layer_elements * d.compute * (2 if train_config.mesh.fsdp > 1 else 0)
  forward = _layer_saved(d, cfg) + d.resid * d.compute * 2 + gathered + _mask_bytes(d)
  ref_config = train_config.replace(param_dtype=train_config.compute_dtype)
  head = _head(d, cfg, ref_config, embed_elements, backward=False)
  return [(f"parameters ({train_config.compute_dtype})", compute_params), ("one layer's forward", forward),
          ("logits, final norm, embedding", head), ("batch", _batch_bytes(train_config))]


# ------------------------------------------------------------------------------------------------ plan


def _check_device_count(train_config: TrainConfig, hardware: Hardware) -> None:
  if hardware.chips is not None and train_config.mesh.size != hardware.chips:
    mesh = train_config.mesh
    raise ConfigError(f"mesh data x fsdp x tensor = {mesh.data} x {mesh.fsdp} x {mesh.tensor} = {mesh.size} "
                      f"devices, but {hardware.name} has {hardware.chips} chips")


def _capacity(hardware: Hardware, train_config: TrainConfig) -> int:
  if hardware.chips is None:  # simulated devices share the host's memory
    return hardware.memory_bytes // train_config.mesh.size
  return hardware.memory_bytes


def memory_plan(train_config: TrainConfig, model_config: GemmaConfig) -> MemoryPlan:
  """Per-device memory of `train_config` training `model_config`, from abstract shapes."""
  hardware = get_hardware(train_config.hardware)
  _check_device_count(train_config, hardware)
  params = _with_dtype(abstract_params(model_config), train_config.param_dtype)
  factors = _shard_factors(params, train_config.mesh.shape)
  param_bytes = sharded_bytes(params, factors)
  trainable, trainable_factors = params, factors
  if train_config.lora_rank > 0:
    trainable = _adapter(train_config, params)
    trainable_factors = _shard_factors(trainable, train_config.mesh.shape)
    param_bytes += sharded_bytes(trainable, trainable_factors)
  optimizer_bytes, moments = _optimizer_bytes(train_config, trainable, trainable_factors)
  optimizer_bytes += _update_working_set(trainable, trainable_factors)
  parts = _activation_parts(train_config, model_config, params)
  reference_parts = _reference_parts(train_config, model_config, params, factors)
  capacity = _capacity(hardware, train_config)
  mesh = train_config.mesh
  return MemoryPlan(
      model=model_config.name or train_config.model, param_count=model_config.param_count(),
      objective=train_config.objective, hardware=hardware.name, mesh=mesh.shape,
      dtypes={"compute": train_config.compute_dtype, "param": train_config.param_dtype, "optimizer": moments},
      micro_batch=train_config.micro_batch, seq_len=train_config.seq_len, grad_accum=train_config.grad_accum,
      sequences_per_device=train_config.micro_batch // (mesh.data * mesh.fsdp)
      * sequences_per_example(train_config.objective),
      remat=train_config.remat, params=param_bytes, grads=sharded_bytes(trainable, trainable_factors),
      adapter_params=_elements(trainable) if trainable is not params else 0, optimizer=optimizer_bytes,
      activations=sum(n for _, n in parts), batch=_batch_bytes(train_config), parts=tuple(parts),
      reference=sum(n for _, n in reference_parts), reference_parts=tuple(reference_parts),
      capacity=capacity, usable=int(capacity * USABLE_FRACTION))


def plan_for(train_config: TrainConfig) -> MemoryPlan:
  """`memory_plan` with the model resolved from `train_config.model`."""
  return memory_plan(train_config, resolve_model_config(train_config.model))


def check_fits(train_config: TrainConfig, model_config: GemmaConfig) -> MemoryPlan:
  """The plan, or ConfigError (its first line the reason, then the table) when it does not fit."""
  plan = memory_plan(train_config, model_config)
  if not plan.fits:
    raise ConfigError(f"does not fit: {plan.reason()}\n{format_plan(plan)}")
  return plan


# ------------------------------------------------------------------------------------------------ table


def _gib(n: int) -> str:
  return f"{n / GIB:.2f}"


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _row(label: str, n: int, indent: int = 2) -> str:
  return f"{' ' * indent}{label:<44}{_gib(n):>9}"


def _gradient_note(plan: MemoryPlan) -> str:
  return f", adapter {_count(plan.adapter_params)}" if plan.adapter_params else ""


def format_plan(plan: MemoryPlan) -> str:
  """A readable per-device table in GiB."""
  mesh = plan.mesh
  seqs = "sequence" if plan.sequences_per_device == 1 else "sequences"
  if plan.objective == "bonbon":
    seqs += " (chosen + rejected)"
  lines = [
      f"memory plan: {plan.model} ({_count(plan.param_count)} params), {plan.objective} on {plan.hardware}, "
      f"mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}",
      f"  batch {plan.micro_batch * plan.grad_accum} = {plan.grad_accum} micro-batch(es) x {plan.micro_batch}; "
      f"per device {plan.sequences_per_device} {seqs} x {plan.seq_len} tokens; remat {'on' if plan.remat else 'off'}",
      "",
      f"  {'per device':<44}{'GiB':>9}",
      _row(f"parameters ({plan.dtypes['param']}{', base + adapter' if plan.adapter_params else ''})", plan.params),
      _row(f"gradients ({plan.dtypes['param']}{_gradient_note(plan)})", plan.grads),
      _row(f"optimizer ({plan.dtypes['optimizer']}) + update", plan.optimizer),
      _row(f"activations (compute {plan.dtypes['compute']})", plan.activations),
      *(_row(label, n, indent=4) for label, n in plan.parts),
      _row("batch", plan.batch),
      _row("total", plan.total),
  ]
  if plan.reference_parts:
    lines += ["", "  BoNBoN reference pass (once, before training; no training state resident)",
              *(_row(label, n, indent=4) for label, n in plan.reference_parts), _row("reference total", plan.reference)]
  verdict = "fits" if plan.fits else "DOES NOT FIT"
  lines += ["", _row(f"usable ({USABLE_FRACTION:.0%} of {_gib(plan.capacity)} GiB)", plan.usable),
            _row("headroom", plan.headroom) + f"   {verdict}"]
  return "\n".join(lines)
