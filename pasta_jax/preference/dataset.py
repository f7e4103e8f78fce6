"""Preference pairs -> `PairBatch`es by optimizer step (the same batch plan as SFT data).

Each side is laid out from its exact sampled token ids (`encode.encode_ids`) with the PASTA
layout, so log p(y|x) in the loss is over precisely the tokens the model produced. Pairs that do
not fit the configured shape are left out and counted, as the SFT pipeline does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from pasta_jax.data.encode import EncodeConfig, encode_ids
from pasta_jax.data.pipeline import BatchPlan, DroppedExample, DropReport, check_plan, drop_reason
from pasta_jax.data.sources import DataError
from pasta_jax.errors import ConfigError, PastaError
from pasta_jax.lang.layout import Layout, stack_layouts
from pasta_jax.training.bonbon import PairBatch


@dataclasses.dataclass(frozen=True)
class EncodedPair:
  chosen: Layout
  rejected: Layout
  ref_chosen: float
  ref_rejected: float


def encode_pair(pair: Mapping, tokenizer, vocab, encode: EncodeConfig) -> tuple[Layout, Layout]:
  where = str(pair.get("id", "?"))
  chosen = encode_ids(pair["prompt"], pair["chosen"]["ids"], tokenizer, vocab, encode, f"{where} (chosen)")
  rejected = encode_ids(pair["prompt"], pair["rejected"]["ids"], tokenizer, vocab, encode, f"{where} (rejected)")
  return chosen, rejected


class PairSteps:
  """`ds[step]`: this host's PairBatch of global batch `step` (numpy leaves); `len(ds)`: steps."""

  def __init__(self, pairs: Sequence[EncodedPair], plan: BatchPlan, report: DropReport):
    self.pairs, self.plan, self.report = pairs, plan, report
    self._order = plan.example_order()

  def __len__(self) -> int:
    return self.plan.num_steps

  def __getitem__(self, step: int) -> PairBatch:
    if not 0 <= step < len(self):
      raise IndexError(f"step {step} is outside the dataset's {len(self)} steps")
    plan = self.plan
    epoch, within = divmod(step, plan.steps_per_epoch)
    start = epoch * plan.num_examples + within * plan.batch_size + plan.shard_index * plan.shard_size
    picked = [self.pairs[int(self._order[start + j])] for j in range(plan.shard_size)]
    return PairBatch(chosen=stack_layouts([p.chosen for p in picked]),
                     rejected=stack_layouts([p.rejected for p in picked]),
                     ref_chosen=np.asarray([p.ref_chosen for p in picked], np.float32),
                     ref_rejected=np.asarray([p.ref_rejected for p in picked], np.float32))


def pair_dataset(pairs: Sequence[Mapping], tokenizer, vocab, encode: EncodeConfig, *, batch_size: int, seed: int,
                 epochs: int, shard_index: int = 0, shard_count: int = 1) -> PairSteps:
  """Pairs with stored reference log-probs -> batches by step. Pairs without them are an error."""
  check_plan(batch_size, seed, epochs, shard_index, shard_count)
  missing = [str(p.get("id")) for p in pairs if "ref_logp" not in p.get("chosen", {})]
  if missing:
    raise DataError(f"{len(missing)} pairs have no stored reference log-probs (first: id {missing[0]}); "
                    "run preference.reference.add_reference_logprobs first")
  kept, dropped = [], []
  for index, pair in enumerate(pairs):
    try:
      chosen, rejected = encode_pair(pair, tokenizer, vocab, encode)
    except PastaError as error:
      dropped.append(DroppedExample(index, str(pair.get("id", index)), drop_reason(error), str(error)))
      continue
    kept.append(EncodedPair(chosen, rejected, float(pair["chosen"]["ref_logp"]), float(pair["rejected"]["ref_logp"])))
  report = DropReport(total=len(pairs), kept=len(kept), dropped=tuple(dropped))
  if not kept:
    raise DataError(f"no pair can be trained on: {report.summary()}")
  if len(kept) < batch_size:
    raise ConfigError(f"global batch_size {batch_size} is more than the {len(kept)} kept pairs ({report.summary()})")
  return PairSteps(kept, BatchPlan(len(kept), batch_size, epochs, seed, shard_index, shard_count), report)
