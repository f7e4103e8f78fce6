"""Superposed Decoding (paper 002) as rules: k drafts for the cost of one decode, on the one step driver.

One lane per request feeds, each step, the superposition of its k drafts' newest tokens: the sum of
their embeddings weighted by gamma_i = p_i / sum_j p_j, the drafts' normalised probabilities (section
3.1). The model runs once; its next-token distribution at temperature tau (0.06) is shared by every
draft. Each alive draft i extends by the top-`candidates` tokens x of that distribution, smoothed by its
own n-gram continuation probabilities (section 3.2):

  log p_f(x) = (1 - alpha) log p_theta(x) + alpha log p_ngram(x)   where p_ngram(x) > 0,
               (1 - alpha) log p_theta(x) + log_delta               where no n-gram matched (delta = e^-200),

and the k x candidates options (score = draft log p + log p_f) are ranked as tensor2tensor's beam search
ranks them: the top 2k, of which those ending in an end id join the finished set (the best k kept) and
the best k others stay alive. A request stops when its k finished drafts all score at least its best
alive one (scores only fall, so nothing alive can overtake them), or at the token budget; its drafts are
then the best k of finished and alive. The first step reads the prefill's distribution alone (section 3:
draft i takes the i-th most probable token); n-gram smoothing starts at the second.

All of it is array code on device inside the one `lax.while_loop`, batched over requests; the n-gram
index (`decode.ngram`) comes in as the run's `rule_inputs`. The lane, its KV slots and its records are
the sequential rules' (`SequentialRules`): the pool holds one shared context row per step, as in the paper.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import ngram
from pasta_jax.decode.rules.base import InterpreterConfig
from pasta_jax.decode.rules.sequential import SequentialRules
from pasta_jax.decode.state import InterpState

NEG = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
  """Superposed Decoding's device state: k alive drafts and the k best finished ones, per request."""

  tokens: jax.Array  # [B, k, G] int32 alive drafts (the first `length` tokens are real)
  score: jax.Array  # [B, k] float32 log probability (-inf: no such draft)
  length: jax.Array  # [B] int32 tokens in every alive draft (they grow together)
  context: jax.Array  # [B, k, C] int32 each alive draft's last C tokens, the prompt's before them (ngram.UNKNOWN)
  done_tokens: jax.Array  # [B, k, G] int32 finished drafts (end id excluded)
  done_length: jax.Array  # [B, k] int32
  done_score: jax.Array  # [B, k] float32 (-inf: empty)
  index: ngram.NgramArrays | None  # read-only


@dataclasses.dataclass(frozen=True)
class SuperposedRules(SequentialRules):
  name: ClassVar[str] = "superposed"
  shared_state: ClassVar[tuple[str, ...]] = ("index",)
  drafts: int = 3  # k
  candidates: int = 0  # tokens of the shared distribution each draft may take (0: 3k)
  temperature: float = 0.06  # tau of p_theta
  ngram_weight: float = 0.54  # alpha; 0 turns n-gram smoothing off (no index needed)
  ngram_orders: tuple[float, ...] = ngram.PAPER_WEIGHTS  # lambda_n for n = 2, 3, ...
  log_delta: float = -200.0  # log of the penalty for an option no n-gram supports

  @property
  def num_candidates(self) -> int:
    return self.candidates or 3 * self.drafts

  def validate(self, cfg: InterpreterConfig) -> None:
    super().validate(cfg)
    if not 1 <= self.drafts <= 16:
      raise ValueError(f"drafts must be in [1, 16], got {self.drafts}")
    if self.num_candidates < 2:
      raise ValueError(f"candidates must be at least 2 (the top 2k of k x candidates options), got {self.candidates}")
    if self.temperature <= 0 or not 0 <= self.ngram_weight < 1:
      raise ValueError(f"need temperature > 0 and 0 <= ngram_weight < 1, got {self.temperature}, {self.ngram_weight}")
    if self.ignore_eos:
      raise ValueError("superposed drafts finish at end ids: ignore_eos is not supported")

  def budgets(self, new_tokens: int, pool_steps: int) -> tuple[int, int]:
    """One draft token per step: the step budget is the drafts' length (the lane's token is a display)."""
    del pool_steps
    return new_tokens - 1, 0

  # --- state ---------------------------------------------------------------------------------------
  def init_rule_state(self, prompt_tokens, lengths, rule_inputs, cfg: InterpreterConfig) -> Drafts:
    if self.ngram_weight > 0 and rule_inputs is None:
      raise ValueError("ngram_weight > 0 needs an n-gram index as rule_inputs (or ngram_weight=0)")
    batch, k = lengths.shape[0], self.drafts
    width = len(self.ngram_orders)  # context tokens: enough for the highest order
    at = lengths[:, None] - width + jnp.arange(width)[None, :]
    tail = jnp.where(at >= 0, jnp.take_along_axis(prompt_tokens, jnp.maximum(at, 0), axis=1), ngram.UNKNOWN)
    room = cfg.max_steps + 1
    empty = jnp.zeros((batch, k, room), jnp.int32)
    first_only = jnp.where(jnp.arange(k) == 0, 0.0, NEG)  # one draft, the prompt, before the first token
    return Drafts(tokens=empty, score=jnp.broadcast_to(first_only, (batch, k)).astype(jnp.float32),
                  length=jnp.zeros((batch,), jnp.int32),
                  context=jnp.broadcast_to(tail[:, None, :], (batch, k, width)).astype(jnp.int32),
                  done_tokens=empty, done_length=jnp.zeros((batch, k), jnp.int32),
                  done_score=jnp.full((batch, k), NEG, jnp.float32),
                  index=rule_inputs if self.ngram_weight > 0 else None)

  def feed_inputs(self, state: InterpState, rows_lane, cfg: InterpreterConfig):
    """[B, 1, k] the alive drafts' newest tokens and [B, 1, k] their weights gamma (eq. 3-4)."""
    d: Drafts = state.rule_state
    newest = jnp.take_along_axis(d.tokens, jnp.maximum(d.length - 1, 0)[:, None, None], axis=2)[..., 0]
    return newest[:, None, :], superposition_weights(d.score)[:, None, :]

  # --- one step of the search ----------------------------------------------------------------------
  def option_scores(self, d: Drafts, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> candidate tokens [B, c] and each alive draft's option scores [B, k, c]."""
    log_p, tokens = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32) / self.temperature, axis=-1),
                                  self.num_candidates)
    step = jnp.broadcast_to(log_p[:, None, :], d.score.shape + log_p.shape[-1:])
    if d.index is not None:
      alpha = self.ngram_weight
      p_ngram = ngram.interpolated(d.index, d.context, jnp.broadcast_to(tokens[:, None, :], step.shape),
                                   self.ngram_orders)
      smoothed = jnp.where(p_ngram > 0, (1 - alpha) * step + alpha * jnp.log(jnp.maximum(p_ngram, 1e-30)),
                           (1 - alpha) * step + self.log_delta)
      step = jnp.where((d.length > 0)[:, None, None], smoothed, step)  # the first step: p_theta alone
    return tokens, d.score[:, :, None] + step

  def select_tokens(self, state: InterpState, rows_lane, row_ok, logits, cfg: InterpreterConfig, model_out=None):
    d: Drafts = state.rule_state
    k, c = self.drafts, self.num_candidates
    tokens, options = self.option_scores(d, logits[:, 0])
    top_score, top_flat = jax.lax.top_k(options.reshape(options.shape[0], k * c), 2 * k)  # [B, 2k]
    parent, token = top_flat // c, jnp.take_along_axis(tokens, top_flat % c, axis=1)
    ends = jnp.isin(token, jnp.asarray(cfg.vocab.eos_ids))
    new = self.extend(d, parent, token, jnp.where(ends, NEG, top_score))
    new = self.finish_drafts(new, d, parent, jnp.where(ends, top_score, NEG))
    update = row_ok[:, 0] & state.live
    per_request = functools.partial(dataclasses.replace, index=None)  # the index has no request axis
    new = jax.tree.map(lambda a, b: jnp.where(update.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                       per_request(new), per_request(d))
    new = dataclasses.replace(new, index=d.index)
    best_alive = jnp.max(new.score, axis=1)
    settled = (jnp.min(new.done_score, axis=1) >= best_alive) | ~jnp.isfinite(best_alive)  # no alive draft can win
    best_newest = jnp.take_along_axis(new.tokens[:, 0], jnp.maximum(new.length - 1, 0)[:, None], axis=1)[:, 0]
    chosen = jnp.where(settled, cfg.vocab.eos_ids[0], best_newest).astype(jnp.int32)
    return dataclasses.replace(state, rule_state=new), chosen[:, None], jnp.zeros(rows_lane.shape, bool)

  def extend(self, d: Drafts, parent, token, alive_score) -> Drafts:
    """The best k options that do not end: their parents' tokens plus the new one. [B, 2k] inputs."""
    score, pick = jax.lax.top_k(alive_score, self.drafts)  # [B, k]
    src = jnp.take_along_axis(parent, pick, axis=1)
    new_token = jnp.take_along_axis(token, pick, axis=1)
    rows = jnp.take_along_axis(d.tokens, src[:, :, None], axis=1)
    rows = jax.vmap(lambda r, t, n: r.at[:, n].set(t, mode="drop"))(rows, new_token, d.length)
    context = jnp.concatenate([jnp.take_along_axis(d.context, src[:, :, None], axis=1)[:, :, 1:],
                               new_token[:, :, None]], axis=2)
    return dataclasses.replace(d, tokens=rows, score=score, length=d.length + 1, context=context)

  def finish_drafts(self, new: Drafts, old: Drafts, parent, ended_score) -> Drafts:
    """Options that end join the finished set (their parent's tokens; the end id is not kept)."""
    k = self.drafts
    tokens = jnp.concatenate([old.done_tokens, jnp.take_along_axis(old.tokens, parent[:, :, None], axis=1)], axis=1)
    lengths = jnp.concatenate([old.done_length, jnp.broadcast_to(old.length[:, None], parent.shape)], axis=1)
    score, pick = jax.lax.top_k(jnp.concatenate([old.done_score, ended_score], axis=1), k)
    return dataclasses.replace(new, done_tokens=jnp.take_along_axis(tokens, pick[:, :, None], axis=1),
                               done_length=jnp.take_along_axis(lengths, pick, axis=1), done_score=score)

  def host_outputs(self, rule_state: Any, request: int) -> dict:
    """The request's k drafts, best first: finished and alive ones ranked together by log probability."""
    d = rule_state
    entries = [(float(d.done_score[request, i]), list(d.done_tokens[request, i, : d.done_length[request, i]]), True)
               for i in range(self.drafts)]
    entries += [(float(d.score[request, i]), list(d.tokens[request, i, : d.length[request]]), False)
                for i in range(self.drafts)]
    ranked = sorted((e for e in entries if np.isfinite(e[0])), key=lambda e: -e[0])[: self.drafts]
    return {"draft_tokens": [[int(t) for t in e[1]] for e in ranked], "draft_scores": [e[0] for e in ranked],
            "draft_finished": [e[2] for e in ranked]}


def superposition_weights(score: jax.Array) -> jax.Array:
  """gamma_i = p_i / sum_j p_j from log probabilities [..., k] (-inf: weight 0; all -inf: the first)."""
  any_alive = jnp.isfinite(jnp.max(score, axis=-1, keepdims=True))
  safe = jnp.where(any_alive, score, jnp.where(jnp.arange(score.shape[-1]) == 0, 0.0, NEG))
  return jax.nn.softmax(safe, axis=-1)
