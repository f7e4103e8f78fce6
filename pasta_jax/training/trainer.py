"""The training loop: one code path from one CPU to a TPU pod slice.

  setup   mesh from the config, memory plan check, state placed by the partitioning rules, resume
          from the newest Orbax checkpoint in `<out>/checkpoints` (the dataset is random access by
          step, so resuming at step k replays exactly the batches an uninterrupted run would see), the
          compiled steps read back from the persistent compilation cache (`compile_cache`);
  loop    one jitted, donated step per global batch, metrics to `<out>/metrics.jsonl`, a progress
          bar on the main process, a checkpoint every `save_every` steps;
  finish  the final params exported as a pasta checkpoint (or adapter) in `<out>/model` (loadable by
          `load_model` and so by the interpreter): written under a temporary name, renamed into place,
          its completion marker written last (`runfiles.publish`); only a marked export is done.
A kill at any moment loses at most the steps after the last checkpoint: the resumed run drops their
metric rows and trains them again, from the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pasta_jax.errors import ConfigError
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.model import lora, runfiles
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import SHIPPED, LoadedModel, base_reference, shipped_adapter, write_generation_file
from pasta_jax.model.mesh import make_mesh
from pasta_jax.model.partitioning import gather_to_host, param_shardings
from pasta_jax.paths import run_path
from pasta_jax.training import step as step_lib
from pasta_jax.training.checkpoints import TrainCheckpoints
from pasta_jax.training.compile_cache import keep_compiled_programs
from pasta_jax.training.config import SFT_OBJECTIVES, TrainConfig
from pasta_jax.training.distributed import batch_slice
from pasta_jax.training.losses import NO_TAGS, KlTags, sft_kl_loss_sum, sft_loss_sum
from pasta_jax.training.metrics_log import MetricsLog, train_flops_per_token
from pasta_jax.training.optimizer import learning_rate_schedule, make_optimizer
from pasta_jax.training.state import create_sharded_state, init_state


class StepDataset(Protocol):
  """Random access by optimizer step: `ds[k]` is this host's slice of global batch k (numpy leaves): slice `index`
  of `count` equal slices, `distributed.batch_slice(mesh)`."""

  def __len__(self) -> int: ...

  def __getitem__(self, step: int): ...


@dataclasses.dataclass(frozen=True)
class TrainResult:
  out_dir: object  # epath.Path: local or gs://
  steps: int  # optimizer steps completed (including those restored)
  resumed_from: int | None
  losses: list[float]  # losses of the steps run by this call
  model_dir: object | None  # exported final model (None when stopped early)


def make_loss_fn(config: TrainConfig, apply_fn: Callable, reference_apply_fn: Callable | None = None,
                 kl_tags: KlTags = NO_TAGS) -> step_lib.LossFn:
  """The objective as a (numerator, denominator, aux) micro-batch loss.

  With kl_weight, reference_apply_fn is the KL's reference model: the adapter-free model on the same params,
  or, given a reference adapter as the loss's extra argument, the model with that adapter instead of the
  trained one. kl_tags: for a PASTA objective, the tags and the positions the KL leaves out (`losses.KlTags`)."""
  # the layout carries mask and targets
  if config.with_kl:
    def sft_kl(params, batch, kl_reference=None):
      reference = params if kl_reference is None else lora.merge(lora.split(params)[0], kl_reference)
      return sft_kl_loss_sum(apply_fn, reference_apply_fn, params, reference, batch, config.kl_weight, kl_tags)
    return sft_kl
  if config.objective in SFT_OBJECTIVES:
    return lambda params, batch: (*sft_loss_sum(apply_fn, params, batch), {})
  from pasta_jax.training.bonbon import bonbon_objective

  def bonbon(params, batch):
    loss, aux = bonbon_objective(apply_fn, params, batch, alpha=config.bonbon_alpha, beta=config.bonbon_beta)
    pairs = jnp.asarray(batch.ref_chosen.shape[0], jnp.float32)
    return loss * pairs, pairs, aux

  return bonbon


def _check_plan(config: TrainConfig, model: LoadedModel) -> None:
  from pasta_jax.training.plan import check_fits
  check_fits(config, model.config)


def _valid_tokens(host_batch) -> int:
  leaves = [x for x in jax.tree.leaves(host_batch) if getattr(x, "dtype", None) == np.bool_]
  return int(np.asarray(leaves[0]).sum()) if leaves else 0


class Trainer:
  """Holds the compiled step and the state; `run()` trains to the end (or `stop_after`)."""

  def __init__(self, config: TrainConfig, model: LoadedModel, dataset: StepDataset, out_dir, *,
               devices=None, check_memory: bool = True, progress: bool = True):
    if len(dataset) == 0:
      raise ConfigError("the dataset yields no batches: fewer kept examples than one global batch")
    self.config, self.model, self.dataset = config, model, dataset
    self.out_dir = run_path(out_dir)
    self.compile_cache = keep_compiled_programs()  # a resumed run reads its steps back instead of compiling them
    self.progress = progress and jax.process_index() == 0
    self.mesh = make_mesh(config.mesh, devices)
    self.batch_slices = _check_host_batch(config, dataset[0], self.mesh)
    if check_memory:
      _check_plan(config, model)
    self.total_steps = min(len(dataset), config.max_steps) if config.max_steps > 0 else len(dataset)
    self.optimizer = make_optimizer(config, self.total_steps)
    self.schedule = learning_rate_schedule(config, self.total_steps)
    self.adapter = adapter_config(config, model)
    gemma = functools.partial(Gemma, model.config, dtype=jnp.dtype(config.compute_dtype), remat=config.remat,
                              mesh=self.mesh if self.mesh.size > 1 else None, attention=config.attention)
    apply_fn = gemma(adapter=self.adapter).apply
    trainable, self.frozen = self._trainable_and_frozen(config, model)
    self.state, self.shardings = create_sharded_state(trainable, self.optimizer, self.mesh)
    self.checkpoints = TrainCheckpoints(self.out_dir / "checkpoints", model.config, config)
    self.resumed_from = self._maybe_resume()
    sample = step_lib.split_micro_batches(dataset[0], config.grad_accum)
    batch_shardings = step_lib.micro_batch_shardings(self.mesh, sample)
    frozen_shardings = None if self.frozen is None else param_shardings(self.frozen, self.mesh)
    self.kl_reference, reference_adapter = self._kl_reference(config)
    loss_args = () if self.kl_reference is None else (param_shardings(self.kl_reference, self.mesh),)
    loss_fn = make_loss_fn(config, apply_fn, gemma(adapter=reference_adapter).apply, self._kl_tags(config))
    self.step_fn = step_lib.make_train_step(loss_fn, self.optimizer, self.schedule, self.shardings,
                                            batch_shardings, frozen_shardings, loss_args)
    self.flops_per_token = train_flops_per_token(model.config, config.seq_len)
    self.log = MetricsLog(self.out_dir, enabled=jax.process_index() == 0)

  def _trainable_and_frozen(self, config: TrainConfig, model: LoadedModel) -> tuple[dict, dict | None]:
    """(what the optimizer sees, the frozen base or None). An adapter run trains only adapter leaves; a
    model loaded from an adapter folder goes on training that adapter over its own base."""
    cast = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, config.param_dtype), tree)
    if self.adapter is None:
      return cast(model.params), None
    if model.adapter is not None:
      if model.adapter.config != self.adapter:
        raise ConfigError(f"the model's adapter is {model.adapter.config}, the run asks for {self.adapter}: "
                          "start from its base instead, or train with the same rank, targets and rows")
      base, trainable = model.adapter.base_params, model.adapter.tree
    else:
      base, trainable = model.params, lora.init_adapter(model.params, self.adapter, jax.random.key(config.seed))
    frozen = cast(base)
    return cast(trainable), jax.device_put(frozen, param_shardings(frozen, self.mesh))

  def _kl_reference(self, config: TrainConfig) -> tuple[dict | None, lora.AdapterConfig | None]:
    """(the KL's reference adapter tree, placed; its config), or (None, None) when the KL pulls toward the base."""
    if not config.kl_reference:
      return None, None
    name = config.kl_reference  # a shipped name, as load_model takes it, or a folder
    folder = (shipped_adapter(name) or name) if name in SHIPPED else name
    if not lora.is_adapter_folder(folder):
      raise ConfigError(f"kl_reference {config.kl_reference!r} is neither a shipped adapter ({', '.join(SHIPPED)}) "
                        "nor a folder holding an adapter.json")
    tree, reference_config, _ = lora.load_adapter(folder)
    lora.check_matches(self.frozen, tree, f"the KL reference {config.kl_reference}")
    tree = jax.tree.map(lambda x: jnp.asarray(x, config.param_dtype), tree)
    return jax.device_put(tree, param_shardings(tree, self.mesh)), reference_config

  def _kl_tags(self, config: TrainConfig) -> KlTags:
    """For a PASTA objective's KL: the tags, which neither the base nor a Baseline-SFT reference writes, and the
    positions out of text order (`losses.KlTags`)."""
    if not (config.with_kl and config.writes_tags) or self.model.tokenizer is None:
      return NO_TAGS
    return KlTags.of(tag_vocab_for(self.model.tokenizer, config.position_mode))

  def _maybe_resume(self) -> int | None:
    latest = self.checkpoints.latest_step()
    if latest is not None:
      shapes = jax.eval_shape(lambda p: init_state(p, self.optimizer), self.state.params)
      self.state = self.checkpoints.restore(latest, shapes, self.shardings)
    if jax.process_index() == 0:  # also with no checkpoint: the rows of a run killed before its first one go
      _truncate_metrics(self.out_dir, latest or 0)
    return latest

  def run(self, stop_after: int | None = None) -> TrainResult:
    """Trains from the current step to the end, or stops (with a checkpoint) after step `stop_after`."""
    start = int(self.state.step)
    end = self.total_steps if stop_after is None else min(stop_after, self.total_steps)
    losses = []
    bar = tqdm(range(start, end), initial=start, total=self.total_steps, desc="train", disable=not self.progress)
    for step in bar:
      losses.append(self._one_step(step, bar))
      done = step + 1
      if done % self.config.save_every == 0 or done == end:
        self.checkpoints.save(done, self.state, force=True)
    self.checkpoints.wait()
    model_dir = self._export() if end == self.total_steps else None
    self.log.close()
    return TrainResult(self.out_dir, end, self.resumed_from, losses, model_dir)

  def _one_step(self, step: int, bar) -> float:
    began = time.perf_counter()
    host_batch = self.dataset[step]
    batch = step_lib.place_batch(host_batch, self.mesh, self.config.grad_accum)
    frozen = () if self.frozen is None else (self.frozen,)
    frozen += () if self.kl_reference is None else (self.kl_reference,)
    self.state, metrics = self.step_fn(self.state, batch, *frozen)
    values = {k: float(v) for k, v in metrics.items()}  # float() waits for the step
    seconds = time.perf_counter() - began
    tokens = int(np.prod(np.shape(jax.tree.leaves(host_batch)[0]))) * self.batch_slices  # the global batch's
    values.update(step_seconds=seconds, tokens_per_s=tokens / seconds,
                  valid_tokens_per_s=_valid_tokens(host_batch) * self.batch_slices / seconds,
                  mfu=self._mfu(tokens, seconds))
    if (step + 1) % self.config.log_every == 0 or step == 0:
      self.log.write(step, values)
    bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['learning_rate']:.2e}")
    return values["loss"]

  def _mfu(self, tokens: int, seconds: float) -> float:
    from pasta_jax.training.plan import peak_flops_per_device
    if self.config.hardware == "cpu" and self.mesh.devices.flat[0].platform != "cpu":
      return math.nan  # no peak is known for these devices (plan.detect_hardware found no entry)
    peak = peak_flops_per_device(self.config.hardware, self.config.compute_dtype) * self.mesh.size
    return self.flops_per_token * tokens / seconds / peak if peak else 0.0

  def _export(self):
    """Writes the model under a temporary name and publishes it as `<out>/model` (marker last): a kill at any
    point leaves either the old export or one without its marker, which a resume exports again."""
    final = self.out_dir / "model"
    primary = jax.process_index() == 0
    tmp = runfiles.partial_folder(final, clear=primary)
    _sync("export: temporary folder ready")
    if self.adapter is not None:
      extra = {"step": int(self.state.step), "train": self.config.to_dict()}
      params = gather_to_host(self.state.params)  # every host takes part in the gather; one writes
      if primary:
        lora.save_adapter(tmp, params, self.adapter, base=base_reference(self.model), extra=extra)
    else:
      from pasta_jax.model.checkpoint import save_checkpoint
      tokenizer = self.model.tokenizer if hasattr(self.model.tokenizer, "save") else None
      save_checkpoint(tmp, self.state.params, self.model.config, tokenizer=tokenizer, step=int(self.state.step),
                      extra={"train": self.config.to_dict()}, overwrite=True, atomic=False)  # every host writes
    if primary and self.config.writes_tags:  # decoded in the mode it learned (`methods.Pasta`)
      write_generation_file(tmp, {"method": "pasta", "position_mode": self.config.position_mode,
                                  "why": "trained to write PASTA tags with these block positions"})
    _sync("export: written")
    if primary:
      runfiles.publish(tmp, final)
    _sync("export: published")
    return final


def adapter_config(config: TrainConfig, model: LoadedModel) -> lora.AdapterConfig | None:
  """The run's adapter (None for full fine-tuning): rank, alpha, targets and the rows of tag/chat tokens."""
  if config.lora_rank <= 0:
    return None
  rows: list[int] = []
  if model.tokenizer is not None and "tags" in config.train_rows:
    rows += tag_vocab_for(model.tokenizer, config.position_mode).tag_ids
  lookup = getattr(model.tokenizer, "token_to_id", None)  # tokenizers without named specials have no chat rows
  if lookup is not None and "chat" in config.train_rows:
    from pasta_jax.model.tokenizer import END_OF_TURN, START_OF_TURN
    rows += [i for i in (lookup(START_OF_TURN), lookup(END_OF_TURN)) if i is not None]
  wanted = lora.AdapterConfig(config.lora_rank, config.lora_alpha, tuple(config.lora_targets),
                              lora.row_ids_for(rows))
  own = model.adapter.config if model.adapter is not None else None
  if own is not None and own != wanted and dataclasses.replace(own, row_ids=wanted.row_ids) == wanted:
    # Going on training a model's adapter: its own embedding rows (the tag vocabulary may have grown since it
    # was trained; its new tags were never in its data)
    if jax.process_index() == 0:
      print(f"trainer: the model's adapter trains rows {own.row_ids}, not {wanted.row_ids}: keeping its rows")
    return own
  return wanted


def _check_host_batch(config: TrainConfig, host_batch, mesh) -> int:
  """The number of distinct batch slices the processes feed. With several processes, refuses a host batch of
  another size than this process's slice: a dataset sharded by process on a mesh whose batch axes do not span the
  processes would feed replicas different examples, and JAX would silently keep one process's."""
  index, count = batch_slice(mesh)
  rows = int(np.shape(jax.tree.leaves(host_batch)[0])[0])
  if jax.process_count() > 1 and (config.batch_size % count or rows != config.batch_size // count):
    raise ConfigError(f"the dataset yields {rows} examples per step on this process; on mesh {dict(mesh.shape)} it "
                      f"must feed slice {index} of {count} of each global batch of {config.batch_size}, "
                      f"{config.batch_size / count:g} examples (shard the data with distributed.batch_slice)")
  return count


def _truncate_metrics(out_dir, resume_step: int) -> None:
  """Drops metric rows of steps a killed run logged after its last checkpoint (they are re-run), and a row the
  kill cut in half; the file is replaced atomically."""
  path = out_dir / "metrics.jsonl"
  if not path.exists():
    return
  rows = list(runfiles.read_rows(path))
  kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] < resume_step]
  if len(kept) < len(rows):
    runfiles.write_rows(path, kept)


def _sync(name: str) -> None:
  """A barrier of every host (nothing with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def train(config: TrainConfig, model: LoadedModel, dataset: StepDataset, out_dir, **kwargs) -> TrainResult:
  stop_after = kwargs.pop("stop_after", None)
  return Trainer(config, model, dataset, out_dir, **kwargs).run(stop_after)
