"""What a decoding method is, to the one step driver (`decode/step.py`): a small, frozen rule object.

The driver owns what every method shares: the pool and its slot metadata, the one visibility rule,
the model call over lane-count buckets, sampling, forced scripts, stop counters and records. A rule
object says only what differs, as array functions over the [B, T] thread table:

  before_model  who feeds this step, spawns and view changes, which pool slot each feeding lane
                writes, and the tokens the interpreter inserts (a fork's `<async>`, APAR's child);
  feed_inputs   what the feeding rows put into the model: their pending ids (the default), or weighted
                mixes of token ids whose embeddings the model sums (a superposed input);
  model_extras  what else the model returns for those rows (Medusa: hidden states, for its heads; none by default);
  allowed       which tokens each query row may sample (tag constraints), and which rows had their most
                likely token refused by a limit (counted, never silent);
  select_tokens how the logits become each row's token: a constrained sample (the default), or a
                method's own search over its `state.rule_state` (Superposed Decoding's drafts);
  script_end    what a forced thread writes once its script has run out;
  after_model   how sampled tokens become pending tokens: closes, releases, finishes;
  cheaper_steps optionally, a cheaper step the loop takes for stretches where the rules' own would do no more
                (ProPD: plain decoding's step while no request plans a tree).

A rule that keeps state of its own (drafts, scores) makes it in `init_rule_state`; the driver carries it
through the loop as `state.rule_state` and hands it to the host through `host_outputs`. Arrays a rule
reads but never changes (an n-gram index) come in as the run's `rule_inputs`.

Everything a rule needs that the driver does not (APAR's depth limit, SoT's fan-out) is a field of
the rule, so the shared config and the shared path carry no method's special case. A new method is a
new rule object; docs/interpreter.md ("Adding a method") walks through one.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from pasta_jax.decode.constraints import constrain
from pasta_jax.decode.sampling import SamplingConfig, sample_rows
from pasta_jax.decode.state import InterpState
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.output import ModelOutput


class InterpreterConfig(Protocol):
  """What rules read of `decode.config.InterpreterConfig` (a protocol: the config holds the rules)."""

  vocab: TagVocab
  lanes: int
  max_threads: int
  pool_slots: int
  max_steps: int
  position_mode: str
  sampling: SamplingConfig


def lane_buckets(most: int) -> tuple[int, ...]:
  """The row-count buckets of a step of at most `most` rows: 1, 2, 4, ... below it, and `most`. The driver
  compiles one model call per bucket (`step.model_on_feeders`); ProPD chooses its tree sizes among them, and
  PASTA x trees runs its heads on as many rows."""
  return tuple(sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most}))


def bucket_index(feed: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  """The smallest bucket of `sizes` (ascending) that holds every request's feeding rows (feed [B, T] bool): the
  count of buckets too small. Counted, not searched: jnp.searchsorted is a while loop, which on a GPU cost the
  step ~19 kernels (the loop, its condition and copies) to pick among 4 buckets."""
  rows = jnp.max(feed.sum(axis=1))
  index = sum((rows > size).astype(jnp.int32) for size in sizes[:-1])
  return jnp.asarray(index, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepFeed:
  """What a rule's `before_model` hands the driver for this step."""

  feed: jax.Array  # [B, T] bool: the lane feeds its pending token
  slots: jax.Array  # [B, T] int32: the pool slot each feeding lane writes (S where none)
  inserted: jax.Array  # [B, K, 5] records of tokens the interpreter inserts this step (before the lanes')
  inserted_keep: jax.Array  # [B, K] bool: which of those rows are real
  plan: Any  # the rule's own plan, handed back to `after_model`


@dataclasses.dataclass(frozen=True)
class CheaperSteps:
  """A cheaper step the loop takes instead of the rules' own while `holds` (`Rules.cheaper_steps`): the step of
  `cfg` (its rules and lanes) on `enter(state)`, in a loop of its own, and `leave(state, inner)` puts the result
  back into the full state. ProPD's: plain decoding's step while no request plans a tree."""

  cfg: Any  # the InterpreterConfig of the cheaper step
  holds: Callable[[InterpState], jax.Array]  # [] bool, on the cheaper step's state: take it (again)
  enter: Callable[[InterpState], InterpState]
  leave: Callable[[InterpState, InterpState], InterpState]


@dataclasses.dataclass(frozen=True)
class Rules(abc.ABC):
  """Base of every method's rules. Subclasses are frozen dataclasses: hashable, so a jit static."""

  name: ClassVar[str] = "rules"
  # Fields of the rule's state that have no request axis (read-only inputs: Medusa's heads, an n-gram index):
  # continuous batching (decode/batching.py) moves rows of everything else and keeps these as they are.
  shared_state: ClassVar[tuple[str, ...]] = ()
  initial_threads: int = 1  # threads that start together after the prompt (main + a fan-out)
  sample_after_script: bool = False  # forced scripts are prefixes: a thread samples once its script ends

  def validate(self, cfg: InterpreterConfig) -> None:
    """Raises ValueError for settings this method cannot honour."""
    if not 1 <= self.initial_threads <= min(cfg.lanes, cfg.max_threads):
      raise ValueError(f"initial_threads={self.initial_threads} must be in [1, min(lanes, max_threads)]")

  def budgets(self, new_tokens: int, pool_steps: int) -> tuple[int, int]:
    """(max_steps, max_content) of a free run of `new_tokens` whose pool leaves room for `pool_steps` steps:
    by default the pool bounds the steps and the answer's content tokens end the run."""
    return pool_steps, new_tokens

  def cheaper_steps(self, cfg: InterpreterConfig) -> CheaperSteps | None:
    """A cheaper step the loop may take instead of this one for stretches of steps (`CheaperSteps`); None (the
    default): every step is the rules' own."""
    del cfg
    return None

  def max_records(self, cfg: InterpreterConfig) -> int:
    """Records one request can make: every record but the last per lane becomes a pool write, and one
    step records at most one token per lane (methods that free slots override this)."""
    return cfg.pool_slots + cfg.lanes + 1

  @abc.abstractmethod
  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array
                   ) -> tuple[InterpState, StepFeed]:
    """Abstract: every method's rules define it."""

  @abc.abstractmethod
  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig
              ) -> tuple[jax.Array | None, jax.Array]:
    """([B, Q, V] bool allowed tokens, or None for no constraint; [B, Q] bool rows whose most likely token a
    limit refused: a fork past a limit, a topic at its cap)."""

  def feed_inputs(self, state: InterpState, rows_lane: jax.Array, cfg: InterpreterConfig
                  ) -> tuple[jax.Array, jax.Array | None]:
    """What the feeding rows put into the model: ([B, Q] pending token ids, None), or, for a method that
    feeds superposed embeddings (Superposed Decoding), ([B, Q, K] ids, [B, Q, K] weights): each input row
    is then sum_k weight_k * embedding(id_k), inside the model (the `token_weights` of its contract)."""
    del cfg
    return state.token[jax.numpy.arange(state.token.shape[0])[:, None], rows_lane], None

  def model_extras(self, state: InterpState, cfg: InterpreterConfig, num_q: int) -> dict:
    """Extra keyword arguments of the model call on `num_q` query rows (Medusa: return_hidden); the fields they
    fill in the model's output reach `select_tokens` in `model_out`. Default: none."""
    del state, cfg, num_q
    return {}

  def select_tokens(self, state: InterpState, rows_lane: jax.Array, row_ok: jax.Array, logits: jax.Array,
                    cfg: InterpreterConfig, model_out: ModelOutput | None = None
                    ) -> tuple[InterpState, jax.Array, jax.Array]:
    """logits [B, Q, V] of the rows in `rows_lane` ([B, Q]; `row_ok` [B, Q] marks the rows that fed) ->
    (state, [B, Q] tokens, [B, Q] bool refused choices). The default samples under `allowed` with each
    lane's own key; a method with its own search overrides it and may update `state.rule_state`.
    model_out: the step's model output, its K/V left out (None after prefill): what `model_extras` asked for is
    in its fields (head_input, kept)."""
    del row_ok, model_out
    batch, num_q, _ = logits.shape
    allowed, refused = self.allowed(state, rows_lane, logits, cfg)
    if allowed is not None:
      logits = constrain(logits, allowed)
    keys = state.sampling.lane_keys(state.step, rows_lane)  # [B, Q]
    per_query = jax.tree.map(lambda x: jnp.repeat(x, num_q), state.sampling)  # each row's values, [B * Q]
    flat = sample_rows(logits.reshape(batch * num_q, -1), keys.reshape(-1), per_query, cfg.sampling)
    return state, flat.reshape(batch, num_q), refused

  def bind_inputs(self, rule_inputs: Any, params: Any) -> Any:
    """The run's read-only rule inputs, given the decode params (Medusa's heads read the model's output head
    from them; a reference, never a copy). Default: unchanged."""
    del params
    return rule_inputs

  def init_rule_state(self, prompt_tokens: jax.Array, lengths: jax.Array, rule_inputs: Any,
                      cfg: InterpreterConfig) -> Any:
    """The rule's own device state after prefill (a pytree; None: the rule keeps none). prompt_tokens:
    [B, P] padded prompts; lengths: [B]; rule_inputs: the run's read-only arrays for the rule."""
    del prompt_tokens, lengths, cfg
    if rule_inputs is not None:
      raise ValueError(f"{self.name} takes no rule_inputs")
    return None

  def host_outputs(self, rule_state: Any, request: int) -> dict | None:
    """What the host result of request `request` keeps of the final (host-side) rule state."""
    del rule_state, request
    return None

  def script_end(self, rows_lane: jax.Array, cfg: InterpreterConfig) -> jax.Array:
    """[B, Q] the token a thread writes once its forced script is spent: an end id."""
    return jax.numpy.full(rows_lane.shape, cfg.vocab.eos_ids[0], jax.numpy.int32)

  @abc.abstractmethod
  def after_model(self, state: InterpState, step: StepFeed, sampled: jax.Array, cfg: InterpreterConfig,
                  length_table: jax.Array) -> tuple[InterpState, jax.Array]:
    """Sampled tokens [B, T] (-1 where a lane did not feed) -> (state, [B, T] bool lanes that recorded)."""
