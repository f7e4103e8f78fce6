"""Plain sequential decoding: prefill, then a fixed-shape `lax.while_loop` on device.

The loop runs in chunks of steps (one chunk = one device call) so a caller can stream text; with
one chunk of `max_new_tokens` steps there is no host round trip at all. Shapes are bucketed
(prompt length and pool size round up to powers of two), so a new prompt rarely recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.sampling import SamplingConfig, sample_rows
from pasta_jax.errors import PastaError
from pasta_jax.model.gemma import KVPool

ModelFn = Callable  # (params, tokens, positions, mask, pool, slots, kv_positions) -> (logits, pool)


def bucket(n: int, minimum: int = 16) -> int:
  """Smallest power of two >= n (and >= minimum): the shape buckets that bound recompiles."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PlainState:
  pool: KVPool  # [L, B, S, K, hd]
  valid: jax.Array  # [B, S] bool: slot holds a real token
  slot_pos: jax.Array  # [B, S] int32: position of each slot
  token: jax.Array  # [B] int32: last sampled token, the next input
  position: jax.Array  # [B] int32: its position
  step: jax.Array  # [] int32: tokens sampled so far per row (the first comes from prefill)
  done: jax.Array  # [B] bool: row has emitted an end token
  out: jax.Array  # [B, N] int32: sampled tokens (pad = -1)
  key: jax.Array


def _pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  if not prompts or any(len(p) == 0 for p in prompts):
    raise PastaError("empty prompt: give at least one token of prompt")
  length = bucket(max(len(p) for p in prompts))
  tokens = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  return tokens, np.array([len(p) for p in prompts], np.int32)


@functools.partial(jax.jit, static_argnames=("model_fn", "pool_slots", "max_new", "sampling", "eos_ids",
                                             "pool_dtype", "num_layers", "kv_heads", "head_dim"))
def prefill(model_fn, params, tokens, lengths, seed, *, pool_slots, max_new, sampling: SamplingConfig,
            eos_ids, pool_dtype, num_layers, kv_heads, head_dim) -> PlainState:
  """Writes the padded prompt [B, P] to slots 0..P-1 and samples the first new token."""
  batch, length = tokens.shape
  pool = KVPool(*(jnp.zeros((num_layers, batch, pool_slots, kv_heads, head_dim), pool_dtype),) * 2)
  idx = jnp.arange(length)
  positions = jnp.broadcast_to(idx, (batch, length))
  real = idx[None, :] < lengths[:, None]  # [B, P]
  slot_idx = jnp.arange(pool_slots)
  valid = jnp.pad(real, ((0, 0), (0, pool_slots - length)))
  slot_pos = jnp.broadcast_to(slot_idx, (batch, pool_slots)).astype(jnp.int32)
  mask = (slot_idx[None, None, :] <= idx[None, :, None]) & valid[:, None, :]  # [B, P, S]
  logits, pool = model_fn(params, tokens, positions, mask, pool, positions, slot_pos)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
  key = jax.random.key(seed)
  first = sample_rows(last, jax.random.split(jax.random.fold_in(key, 0), batch), sampling)
  out = jnp.full((batch, max_new), -1, jnp.int32).at[:, 0].set(first)
  return PlainState(pool, valid, slot_pos, first, lengths, jnp.int32(1), jnp.isin(first, jnp.array(eos_ids)),
                    out, key)


def plain_step(model_fn, params, state: PlainState, prompt_slots: int, sampling: SamplingConfig,
               eos_ids) -> PlainState:
  """Feeds every row's last token (one query row each) and samples the next."""
  batch = state.token.shape[0]
  slot = prompt_slots + state.step - 1  # decode tokens go after the padded prompt region
  slots = jnp.full((batch, 1), slot, jnp.int32)
  valid = state.valid.at[:, slot].set(True)
  slot_pos = state.slot_pos.at[:, slot].set(state.position)
  slot_idx = jnp.arange(valid.shape[1])
  mask = (valid & (slot_idx[None, :] <= slot))[:, None, :]  # [B, 1, S]
  logits, pool = model_fn(params, state.token[:, None], state.position[:, None], mask, state.pool, slots,
                          slot_pos)
  keys = jax.random.split(jax.random.fold_in(state.key, state.step), batch)
  token = sample_rows(logits[:, 0], keys, sampling)
  token = jnp.where(state.done, -1, token)
  out = state.out.at[:, state.step].set(token)
  done = state.done | jnp.isin(token, jnp.array(eos_ids))
  return PlainState(pool, valid, slot_pos, token, state.position + 1, state.step + 1, done, out, state.key)


@functools.partial(jax.jit, static_argnames=("model_fn", "prompt_slots", "sampling", "eos_ids", "chunk"),
                   donate_argnames=("state",))
def decode_chunk(model_fn, params, state: PlainState, *, prompt_slots, sampling, eos_ids, chunk) -> PlainState:
  """Up to `chunk` steps in one `lax.while_loop`; stops early when every row is done or full."""
  limit = jnp.minimum(state.step + chunk, state.out.shape[1])

  def cond(s: PlainState):
    return (s.step < limit) & ~jnp.all(s.done)

  def body(s: PlainState):
    return plain_step(model_fn, params, s, prompt_slots, sampling, eos_ids)

  return jax.lax.while_loop(cond, body, state)


@dataclasses.dataclass(frozen=True)
class PlainDecoder:
  """Greedy/sampled sequential decoding for a model function (Gemma.apply or any with its contract)."""

  model_fn: ModelFn
  num_layers: int
  kv_heads: int
  head_dim: int
  eos_ids: tuple[int, ...]
  pool_dtype: jnp.dtype = jnp.float32

  def start(self, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            sampling: SamplingConfig) -> tuple[PlainState, int]:
    tokens, lengths = _pad_prompts(prompts)
    pool_slots = bucket(tokens.shape[1] + max_new_tokens)
    state = prefill(self.model_fn, params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.uint32(sampling.seed),
                    pool_slots=pool_slots, max_new=max_new_tokens, sampling=unseeded(sampling), eos_ids=self.eos_ids,
                    pool_dtype=self.pool_dtype, num_layers=self.num_layers, kv_heads=self.kv_heads,
                    head_dim=self.head_dim)
    return state, tokens.shape[1]

  def stream(self, params, prompts, max_new_tokens: int, sampling: SamplingConfig,
             chunk: int = 16) -> Iterator[np.ndarray]:
    """Yields the out buffer [B, N] (pad -1) after prefill and after each chunk of steps."""
    state, prompt_slots = self.start(params, prompts, max_new_tokens, sampling)
    yield np.asarray(state.out)
    while int(state.step) < max_new_tokens and not bool(jnp.all(state.done)):
      state = decode_chunk(self.model_fn, params, state, prompt_slots=prompt_slots, sampling=unseeded(sampling),
                           eos_ids=self.eos_ids, chunk=chunk)
      yield np.asarray(state.out)

  def generate(self, params, prompts, max_new_tokens: int, sampling: SamplingConfig) -> list[list[int]]:
    """Whole generation: prefill + one device loop. Returns each row's tokens up to and incl. its end."""
    *_, out = self.stream(params, prompts, max_new_tokens, sampling, chunk=max_new_tokens)
    return [trim(row, self.eos_ids) for row in out]


def unseeded(sampling: SamplingConfig) -> SamplingConfig:
  """The static part of a sampling config: the seed travels as a traced value (no recompile)."""
  return dataclasses.replace(sampling, seed=0)


def trim(row: np.ndarray, eos_ids: Sequence[int]) -> list[int]:
  """Tokens of one out row up to and including the first end token (pad -1 dropped)."""
  tokens = []
  for t in row.tolist():
    if t < 0:
      break
    tokens.append(t)
    if t in eos_ids:
      break
  return tokens
