"""BoNBoN rounds: sample -> score -> BoNBoN, r times, each round starting from the last model.

  <out>/round_<k>/pairs/    build.py's files (samples, verdicts, scores, pairs with reference log-probs)
  <out>/round_<k>/train/    the trainer's run (checkpoints, metrics, loss.png, the exported model)
A round whose exported model is complete (its marker, written last when the trainer publishes it:
`runfiles.is_complete`) is done and skipped; an interrupted round resumes inside its own files
(sampling and judging per prompt, training from its last checkpoint, the export redone). The reference model
of every round is the Pasta-SFT model the first round starts from, as the later paper does
(`reference="round_start"` makes it each round's start model instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from pasta_jax.data.encode import EncodeConfig
from pasta_jax.model import runfiles
from pasta_jax.model.load import load_model
from pasta_jax.preference.build import PAIRS, BuildSummary, Samplers, build_pairs
from pasta_jax.preference.config import PreferenceConfig
from pasta_jax.preference.dataset import pair_dataset
from pasta_jax.preference.reference import add_reference_logprobs
from pasta_jax.training.config import TrainConfig
from pasta_jax.training.distributed import batch_slice
from pasta_jax.training.trainer import Trainer, TrainResult

BONBON_LEARNING_RATE = 5e-7  # the later paper's BoNBoN learning rate
DEFAULT_SAMPLERS = Samplers()


@dataclasses.dataclass(frozen=True)
class RoundResult:
  index: int
  start_model: str
  model_dir: str | None  # None when training stopped early (--stop-after)
  summary: BuildSummary | None  # None when the round was already done
  losses: tuple[float, ...]


def encode_config(config: TrainConfig) -> EncodeConfig:
  return EncodeConfig(seq_len=config.seq_len, num_threads=config.num_threads, position_mode=config.position_mode)


def train_bonbon(pairs: Sequence[dict], model, config: TrainConfig, out_dir, *, stop_after: int | None = None,
                 progress: bool = True) -> TrainResult:
  """BoNBoN on pairs that carry reference log-probs; the policy starts from `model`."""
  config = config.replace(objective="bonbon")
  shard_index, shard_count = batch_slice(config.mesh)  # replicas across hosts feed the same pairs
  dataset = pair_dataset(pairs, model.tokenizer, model.tokenizer.tag_vocab(), encode_config(config),
                         batch_size=config.batch_size, seed=config.seed, epochs=config.epochs,
                         shard_index=shard_index, shard_count=shard_count)
  if progress:
    print(f"pairs: {dataset.report.summary()}; {len(dataset)} steps")
  return Trainer(config, model, dataset, out_dir, progress=progress).run(stop_after)


def run_round(index: int, start_model: str, baseline, records, judge_for: Callable, pref: PreferenceConfig,
              train: TrainConfig, out_dir, *, load: Callable = load_model, samplers: Samplers = DEFAULT_SAMPLERS,
              stop_after: int | None = None, progress: bool = True, reference_model: str | None = None) -> RoundResult:
  """One round from `start_model` (a path). `judge_for(folder)` gives the (cached) judge of the round;
  the reference log-probs come from `reference_model` (None: the start model)."""
  round_dir = Path(out_dir) / f"round_{index}"
  exported = round_dir / "train" / "model"
  if runfiles.is_complete(exported):
    return RoundResult(index, start_model, str(exported), None, ())
  policy = load(start_model)
  pairs_dir = round_dir / "pairs"
  round_pref = dataclasses.replace(pref, seed=pref.seed + index)
  summary = build_pairs(policy, baseline, records, judge_for(pairs_dir), round_pref, pairs_dir,
                        identity={"start_model": start_model, "round": index}, samplers=samplers, progress=progress)
  if progress:
    print(f"round {index}: {summary.line()}")
  reference = policy if reference_model in (None, start_model) else load(reference_model)
  pairs = add_reference_logprobs(pairs_dir / PAIRS, reference, encode_config(train), progress=progress)
  result = train_bonbon(pairs, policy, train, round_dir / "train", stop_after=stop_after, progress=progress)
  model_dir = str(result.model_dir) if result.model_dir is not None else None
  return RoundResult(index, start_model, model_dir, summary, tuple(result.losses))


def run_rounds(rounds: int, start_model: str, baseline, records, judge_for: Callable, pref: PreferenceConfig,
               train: TrainConfig, out_dir, *, reference: str = "sft", **kwargs) -> list[RoundResult]:
  """r rounds; round k+1 starts from round k's exported model. Stops early if a round is cut short.

  reference: "sft" (the paper's: the first start model is every round's reference) or "round_start".
  """
  if reference not in ("sft", "round_start"):
    raise ValueError(f"reference={reference!r}; use 'sft' or 'round_start'")
  results, model = [], start_model
  for index in range(1, rounds + 1):
    ref = start_model if reference == "sft" else model
    result = run_round(index, model, baseline, records, judge_for, pref, train, out_dir, reference_model=ref, **kwargs)
    results.append(result)
    if result.model_dir is None:
      break
    model = result.model_dir
  return results
