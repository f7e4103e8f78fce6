"""The reference model's log p(y|x) of each pair, computed once and stored with it.

BoNBoN's IPO term compares the policy's log-ratio with the reference's (the model the round starts
from). Storing the reference log-probs in pairs.jsonl means training runs one model, not two, and
a resumed run reads the very values the first one used. Each value is stamped with the model and
the layout settings it was computed under; other settings are refused rather than mixed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pasta_jax.data.encode import EncodeConfig
from pasta_jax.data.sources import DataError
from pasta_jax.lang.layout import stack_layouts
from pasta_jax.lang.tags import tag_vocab_for
from pasta_jax.model import runfiles
from pasta_jax.model.gemma import Gemma
from pasta_jax.preference.dataset import encode_pair
from pasta_jax.training.losses import sequence_logprob


def stamp(model_name: str, encode: EncodeConfig) -> dict:
  return {"model": model_name, "position_mode": encode.position_mode, "chat": encode.chat}


@functools.lru_cache(maxsize=4)
def _logprob_fn(config, dtype):
  apply_fn = Gemma(config, dtype=dtype).apply
  return jax.jit(lambda params, batch: sequence_logprob(apply_fn, params, batch))


def add_reference_logprobs(pairs_path: str | Path, model, encode: EncodeConfig, *, batch_size: int = 8,
                           progress: bool = True) -> list[dict]:
  """Fills `ref_logp` on both sides of every pair that lacks it; rewrites the file once. Returns the pairs."""
  pairs = list(runfiles.read_rows(pairs_path))
  want = stamp(model.source, encode)
  stale = [p for p in pairs if "ref" in p and p["ref"] != want]
  if stale:
    raise DataError(f"{pairs_path}: reference log-probs were computed with {stale[0]['ref']}, not {want}; "
                    "use a fresh pairs file (or the same model and layout settings)")
  todo = [p for p in pairs if "ref" not in p]
  if not todo:
    return pairs
  vocab = tag_vocab_for(model.tokenizer, encode.position_mode)
  unpadded = EncodeConfig(seq_len=None, num_threads=None, position_mode=encode.position_mode,
                          chat=encode.chat)  # every pair gets a value, even one training will drop
  sides = [encode_pair(p, model.tokenizer, vocab, unpadded) for p in todo]
  values = _by_length(model, [layout for pair in sides for layout in pair], batch_size, progress)
  for k, pair in enumerate(todo):
    pair["chosen"]["ref_logp"], pair["rejected"]["ref_logp"] = float(values[2 * k]), float(values[2 * k + 1])
    pair["ref"] = want
  runfiles.write_rows(pairs_path, pairs)
  return pairs


def _by_length(model, layouts, batch_size: int, progress: bool) -> np.ndarray:
  """Sorted by length and padded per batch to a bucket of 64, so few shapes compile."""
  order = sorted(range(len(layouts)), key=lambda i: layouts[i].length)
  values = np.zeros(len(layouts), np.float32)
  for start in tqdm(range(0, len(order), batch_size), desc="reference log-probs", disable=not progress, leave=False):
    idx = order[start:start + batch_size]
    part = [layouts[i] for i in idx]
    length = -(-max(x.length for x in part) // 64) * 64
    threads = max(x.num_threads for x in part)
    part += [part[-1]] * (batch_size - len(part))
    batch = stack_layouts(part, length=length, num_threads=threads)
    values[idx] = np.asarray(_logprob_fn(model.config, jnp.float32)(model.params, batch))[:len(idx)]
  return values
