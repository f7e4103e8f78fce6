"""Quality proxies that need no strong judge: ROUGE-L against a reference answer (`lang.metrics.rouge_l`,
pure text), and the per-token log-likelihood of an answer under a fixed scoring model (Baseline-SFT in
`bench.learned`).

Both are weak stand-ins for a judge: ROUGE-L rewards wording close to the reference (gemma-7b-it's
answers in alpaca_eval_805), the log-likelihood rewards answers that the scoring model finds fluent
and typical. Neither says an answer is right.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.data.encode import EncodeConfig, encode_example
from pasta_jax.model.gemma import Gemma
from pasta_jax.training.losses import token_logprobs


@functools.lru_cache(maxsize=4)
def _logprob_fn(config):
  apply_fn = Gemma(config).apply
  return jax.jit(lambda params, layout: token_logprobs(apply_fn, params, layout))


def answer_layout(model, prompt: str, answer: str, chat: bool = True, bucket: int = 128):
  """A tag-free `answer` to `prompt` as one training layout (Baseline-SFT's: the answer and its end token are the
  loss tokens), its length padded to a multiple of `bucket`, batched as [1, L]."""
  tokenizer, vocab = model.tokenizer, model.tokenizer.tag_vocab()
  record = {"instruction": prompt, "output": answer}
  probe = encode_example(record, tokenizer, vocab, EncodeConfig(seq_len=None, chat=chat, objective="baseline_sft"))
  seq_len = -(-int(probe.length) // bucket) * bucket
  layout = encode_example(record, tokenizer, vocab, EncodeConfig(seq_len=seq_len, chat=chat, objective="baseline_sft"))
  return jax.tree.map(lambda x: jnp.asarray(x)[None], layout)


def answer_logprob(model, prompt: str, answer: str, chat: bool = True, bucket: int = 128) -> tuple[float, int]:
  """(mean log p per answer token, answer tokens) of a tag-free `answer` under `model`, the end token
  included (a model that would not stop there is penalized). Lengths pad to multiples of `bucket`."""
  batch = answer_layout(model, prompt, answer, chat, bucket)
  logp = np.asarray(_logprob_fn(model.config)(model.params, batch))[0]
  count = int(np.asarray(batch.loss_mask).sum())
  return float(logp.sum() / max(count, 1)), count


def answer_token_logprobs(model, prompt: str, answer: str, chat: bool = True,
                          bucket: int = 128) -> tuple[np.ndarray, np.ndarray]:
  """([N] log p of each token of a tag-free `answer` under `model`, the end token last; [N] the character of
  `answer` where each token starts, len(answer) for the end token): `answer_logprob` token by token, placed."""
  batch = answer_layout(model, prompt, answer, chat, bucket)
  logp = np.asarray(_logprob_fn(model.config)(model.params, batch))[0]
  loss_mask = np.asarray(batch.loss_mask)[0].astype(bool)
  targets = np.asarray(batch.targets)[0][loss_mask].tolist()
  starts = [min(len(model.tokenizer.decode(targets[:k])), len(answer)) for k in range(len(targets) - 1)]
  return logp[loss_mask], np.asarray(starts + [len(answer)])


@functools.lru_cache(maxsize=4)
def _continuation_fn(config):
  from pasta_jax.model.gemma import causal_mask
  model = Gemma(config)

  def logprobs(params, tokens):  # [B, L] -> [B, L-1] log p(token t | tokens < t)
    batch, length = tokens.shape
    logits = model.apply(params, tokens, jnp.broadcast_to(jnp.arange(length), (batch, length)),
                         causal_mask(batch, length)).logits
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

  return jax.jit(logprobs)


def continuation_perplexity(model, prefix: Sequence[int], continuation: Sequence[int], bucket: int = 64) -> float:
  """exp(-mean log p) of the `continuation` token ids after `prefix` (ids, BOS included) under `model`, at
  temperature 1: the paper 002 measure of a draft's quality. Lengths pad to multiples of `bucket`."""
  if not continuation:
    return float("nan")
  ids = list(prefix) + list(continuation)
  length = -(-len(ids) // bucket) * bucket
  tokens = jnp.asarray([ids + [0] * (length - len(ids))], jnp.int32)
  logp = np.asarray(_continuation_fn(model.config)(model.params, tokens))[0]
  return float(np.exp(-logp[len(prefix) - 1: len(ids) - 1].mean()))
