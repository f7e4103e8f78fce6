"""Continuous batching on the one loop: B rows, one request each, refilled between chunks of steps.

A `RowBatch` holds one compiled method (its rules, lanes and a pool of S slots per row) and one
`InterpState` of fixed shape that stays on device. Between chunks the host:
  - reads the small part of the state (`peek`: records and flags, never the pool),
  - frees rows (`release`: finished, cancelled or cut requests leave the batch),
  - prefills newcomers into free rows (`admit`): only the newcomers run through the model, and their
    rows of the pool and thread table are written in place (the state is donated, nothing is copied);
    their records' steps are shifted by the batch's step, so each request counts steps from its
    admission, and their budgets (content tokens, steps, pool slots) are their own.
`run_chunk` is `loop.run_steps`: the same compiled step, K steps per device call, no recompile.

Every request decodes exactly as `generate` decodes it alone (greedy): the per-row budgets are the ones
`api.prepare` would give it (`row_budgets`), and rows never see each other.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode import loop
from pasta_jax.decode.config import InterpreterConfig
from pasta_jax.decode.loop import RunOutput, bucket
from pasta_jax.decode.sampling import RowSampling, SamplingConfig
from pasta_jax.decode.state import STEP, InterpState
from pasta_jax.decode.step import cut_at_budget
from pasta_jax.errors import PastaError

MIN_SLOT_BUCKET = 32  # the smallest pool prefix a chunk attends over
SHARED_FIELDS = ("step",)  # InterpState leaves without a batch axis
HOST_FIELDS = ("records", "num_records", "finished", "truncated", "pool_full", "budget_spent", "content",
               "stalls", "refusals", "head_fallbacks", "last_fed_step", "peak_live", "parent", "step")


@dataclasses.dataclass(frozen=True)
class RowBudget:
  """One request's budgets, as `api.prepare` sizes a run of it alone."""

  content: int  # content tokens (0: none)
  steps: int  # steps from admission
  slots: int  # pool slots (the prompt included)


def row_budgets(cfg: InterpreterConfig, prompt_len: int, max_new_tokens: int, scripts=None) -> RowBudget:
  """The budgets `api.prepare` gives a run of this prompt alone, bounded by the batch's pool: free, or with
  per-thread `scripts` (replayed whole; then the pool's room, not a content budget, ends the run)."""
  padded = bucket(prompt_len)
  new = max_new_tokens if scripts is None else max(max_new_tokens, sum(map(len, scripts)) + 2 * len(scripts))
  if padded >= cfg.pool_slots:
    raise PastaError(f"a prompt of {prompt_len} tokens (padded to {padded}) does not fit a pool of "
                     f"{cfg.pool_slots} slots")
  slots, steps, content = loop.free_budget(prompt_len, new, cfg.lanes, cfg.rules, max_slots=cfg.pool_slots)
  return RowBudget(content=content if scripts is None else 0, steps=steps, slots=slots)


def batch_config(cfg: InterpreterConfig, max_new_tokens: int) -> InterpreterConfig:
  """A config for chunked serving of requests of up to `max_new_tokens`: the largest row budgets sized
  in (the record buffer is sized by the step budget), the content budget compiled in."""
  steps, content = cfg.rules.budgets(max_new_tokens, cfg.pool_slots)
  return dataclasses.replace(loop.static_config(cfg), max_steps=steps, max_content=max(content, 1))


def _per_row(rule_state, shared: tuple[str, ...]):
  """The rule state without its `shared` fields (those have no request axis: `Rules.shared_state`)."""
  if rule_state is None or not shared:
    return rule_state
  return dataclasses.replace(rule_state, **{name: None for name in shared})


def _with_shared(rule_state, source, shared: tuple[str, ...]):
  """`rule_state` with its `shared` fields taken from `source`."""
  if rule_state is None or not shared:
    return rule_state
  return dataclasses.replace(rule_state, **{name: getattr(source, name) for name in shared})


def _put_rows(running: InterpState, new: InterpState, rows: jax.Array, shared: tuple[str, ...] = ()) -> InterpState:
  """`running` with rows `rows` [n] replaced by `new`'s n rows (index B: a padding row, dropped); the rule
  state's `shared` fields stay `running`'s."""
  def put(axis, slots=None):
    index = (slice(None),) * axis + (rows,) + (() if slots is None else (slice(0, slots),))
    return lambda old, upd: old.at[index].set(upd.astype(old.dtype), mode="drop")
  # [layers, B, S, K, hd]: the newcomers' pool may hold only their prompts' first P slots (`prompt_pool`); the slots
  # past them keep what an earlier request wrote there, invalid in the new slot table, so never read
  changes = {"pool": jax.tree.map(put(1, new.pool.k.shape[2]), running.pool, new.pool)}
  for field in dataclasses.fields(InterpState):
    if field.name not in SHARED_FIELDS + ("pool", "rule_state"):
      changes[field.name] = jax.tree.map(put(0), getattr(running, field.name), getattr(new, field.name))
  rows_put = jax.tree.map(put(0), _per_row(running.rule_state, shared), _per_row(new.rule_state, shared))
  changes["rule_state"] = _with_shared(rows_put, running.rule_state, shared)
  return dataclasses.replace(running, **changes)


STATIC = ("model_fn", "cfg", "vocab_size", "pool_spec", "forced")


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("state",))
def admit(model_fn, params, state: InterpState, tokens, lengths, rows, content_budget, step_budget, slot_limit,
          script, script_len, sampling: RowSampling, rule_inputs=None, *, cfg: InterpreterConfig, vocab_size: int,
          pool_spec: tuple, forced: bool = False) -> InterpState:
  """Prefills the newcomers' prompts (tokens [n, P], lengths [n]) with their per-thread scripts ([n, U, L],
  [n, U]) and writes them into rows [n] of the running batch with their budgets ([n] each; step_budget counts
  from now) and sampling values (`RowSampling`, leaves [n]: within cfg.sampling's envelope; their keys count
  steps from now, so a seeded request draws what it draws alone)."""
  new = loop.start_state(model_fn, params, tokens, lengths, script, script_len, sampling, rule_inputs, cfg=cfg,
                         forced=forced, vocab_size=vocab_size, pool_spec=pool_spec, prompt_pool=True)
  offset = state.step
  # The prefill cut at the batch's compiled budget (cfg.max_content); the rows' own budgets replace it (a row
  # budget of 0 means none: Superposed Decoding's drafts end by steps)
  new = dataclasses.replace(
      new, records=new.records.at[:, :, STEP].add(offset), last_fed_step=new.last_fed_step + offset,
      content_budget=content_budget, step_limit=offset + step_budget, slot_limit=slot_limit,
      truncated=new.truncated & ~new.budget_spent, budget_spent=jnp.zeros_like(new.budget_spent),
      sampling=dataclasses.replace(new.sampling, first_step=jnp.full_like(new.sampling.first_step, offset)))
  return _put_rows(state, cut_at_budget(new, cfg), rows, cfg.rules.shared_state)


@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: InterpState, rows: jax.Array) -> InterpState:
  """Rows [B] bool leave the batch: they stop being live (their slots are rewritten by the next admit)."""
  return dataclasses.replace(state, truncated=state.truncated | rows)


def _take_rows(state: InterpState, rows: int, shared: tuple[str, ...] = ()) -> InterpState:
  """The first `rows` rows of the batch (shared fields, and the rule state's `shared` ones, as they are)."""
  changes = {"pool": jax.tree.map(lambda x: x[:, :rows], state.pool)}
  for field in dataclasses.fields(InterpState):
    if field.name not in SHARED_FIELDS + ("pool", "rule_state"):
      changes[field.name] = jax.tree.map(lambda x: x[:rows], getattr(state, field.name))
  taken = jax.tree.map(lambda x: x[:rows], _per_row(state.rule_state, shared))
  changes["rule_state"] = _with_shared(taken, state.rule_state, shared)
  return dataclasses.replace(state, **changes)


SLOT_FIELDS = ("slot_owner", "slot_order", "slot_pos", "slot_valid", "slot_token")  # InterpState's [B, S] leaves


def _take_slots(state: InterpState, slots: int) -> InterpState:
  """The first `slots` slots of the pool and of the slot table."""
  changes = {name: getattr(state, name)[:, :slots] for name in SLOT_FIELDS}
  return dataclasses.replace(state, pool=jax.tree.map(lambda x: x[:, :, :slots], state.pool), **changes)


@functools.partial(jax.jit, static_argnames=("rows", "slots", "shared"))
def take_part(whole: InterpState, *, rows: int, slots: int, shared: tuple[str, ...] = ()) -> InterpState:
  """A copy of the first `rows` rows and `slots` slots of the batch (`RowBatch.hold`)."""
  return _take_slots(_take_rows(whole, rows, shared), slots)


@functools.partial(jax.jit, static_argnames=("shared",), donate_argnames=("whole",))
def put_part(whole: InterpState, part: InterpState, *, shared: tuple[str, ...] = ()) -> InterpState:
  """`whole` with `take_part`'s prefix replaced by `part` (written in place: every leaf of `part` is a prefix of
  `whole`'s in every axis); the rule state's `shared` fields (no request axis) are `part`'s."""
  def put(full, prefix):
    return jax.lax.dynamic_update_slice(full, prefix.astype(full.dtype), (0,) * full.ndim)
  merged = jax.tree.map(put, dataclasses.replace(whole, rule_state=_per_row(whole.rule_state, shared)),
                        dataclasses.replace(part, rule_state=_per_row(part.rule_state, shared)))
  return dataclasses.replace(merged, rule_state=_with_shared(merged.rule_state, part.rule_state, shared))


@functools.partial(jax.jit, static_argnames=("model_fn", "cfg", "vocab_size", "forced"), donate_argnames=("state",))
def run_chunk(model_fn, params, state: InterpState, steps, *, cfg: InterpreterConfig, vocab_size: int,
              forced: bool = False) -> InterpState:
  """Up to `steps` steps (traced: every chunk length runs one program) of every row of `state` in one device call,
  over its `cfg.pool_slots` slots: the batch's whole state, or a prefix of it that holds every live row and every
  slot a live row may write (`RowBatch.hold`: rows past it are free, and a free row never changes; a slot past
  every row's limit is never written and hidden from every row, so attending over it costs time and changes
  nothing). The batch's step counter runs on across requests (each row stops at its own `step_limit`), so it is
  not bounded by cfg.max_steps."""
  return loop.run_loop(model_fn, params, state, state.step + steps, cfg, forced, vocab_size)


def decode_programs() -> int:
  """The batch programs this process holds compiled: chunks (one per rows and slots prefix), admissions (group
  size x prompt bucket), releases and the copies that hold a batch at a prefix, over every batch. New sampling
  values never add one: they are traced."""
  return sum(f._cache_size() for f in (admit, run_chunk, release, take_part, put_part))


def empty_batch(model_fn, params, batch: int, *, cfg: InterpreterConfig, vocab_size: int,
                pool_spec: tuple, rule_inputs=None, script_len: int = 1) -> InterpState:
  """A batch of `batch` free rows (a one-token prefill of each, then released); scripts of up to
  `script_len` tokens per thread."""
  tokens = jnp.ones((batch, bucket(1)), jnp.int32)
  lengths = jnp.ones((batch,), jnp.int32)
  script = jnp.zeros((batch, cfg.max_threads, script_len), jnp.int32)
  state = loop.start(model_fn, params, tokens, lengths, script, jnp.zeros((batch, cfg.max_threads), jnp.int32),
                     idle_sampling(batch), rule_inputs, cfg=cfg, forced=False, vocab_size=vocab_size,
                     pool_spec=pool_spec)
  return release(state, jnp.ones((batch,), bool))


def idle_sampling(rows: int) -> jax.Array:
  """Sampling values of rows that hold no request: greedy, no penalty (a step's sampling work skips them)."""
  return jax.tree.map(jnp.asarray, RowSampling.of([SamplingConfig()] * rows, [0] * rows))


@dataclasses.dataclass(frozen=True)
class HostView:
  """The host's copy of the small part of a batch's state (no pool)."""

  fields: dict  # HOST_FIELDS -> numpy arrays
  rule_state: object  # numpy pytree of the rules' own state (None for most methods)

  @property
  def step(self) -> int:
    return int(self.fields["step"])

  def live(self, row: int) -> bool:
    return not (self.fields["finished"][row] or self.fields["truncated"][row])

  def run_output(self, row: int, cfg: InterpreterConfig, admitted_at: int) -> RunOutput:
    """The request in `row` so far, as `loop.unpack` gives it for a run of its own (steps from admission)."""
    f = self.fields
    n = int(f["num_records"][row])
    records = np.array(f["records"][row, :n])
    records[:, STEP] -= admitted_at
    return RunOutput(
        records=records, logits=None, steps=max(int(f["last_fed_step"][row]) - admitted_at, 0),
        stalls=int(f["stalls"][row]), finished=bool(f["finished"][row]), truncated=bool(f["truncated"][row]),
        pool_full=bool(f["pool_full"][row]), budget_spent=bool(f["budget_spent"][row]),
        content=int(f["content"][row]), refusals=int(f["refusals"][row]),
        head_fallbacks=int(f["head_fallbacks"][row]),
        peak_live_slots=int(f["peak_live"][row]), parents=np.asarray(f["parent"][row]),
        rule_outputs=cfg.rules.host_outputs(self.rule_state, row) if self.rule_state is not None else None)


def peek(state: InterpState, shared: tuple[str, ...] = ()) -> HostView:
  """Copies the records and flags of every row to the host (one transfer; the pool and the rule state's
  shared inputs stay on device)."""
  fields, rule_state = jax.device_get(({k: getattr(state, k) for k in HOST_FIELDS},
                                       _per_row(state.rule_state, shared)))
  return HostView(fields, rule_state)


class RowBatch:
  """The host's handle on one batch: which request holds which row, admission, chunks, release.

  `cfg` is the batch's config (`batch_config`); rows are admitted in groups padded to a power of two (so
  only log2(B) admission shapes per prompt bucket compile); a row's records count steps from its admission.
  `script_len` > 0: every row brings per-thread scripts of up to that many tokens (SoT's point prompts,
  which its threads read before they sample: `rules.sample_after_script`); 0: free decoding.

  `state` is held at the rows and slots the next chunk runs on (`hold`), so a chunk runs on it in place: the
  smallest power-of-two prefix of rows that holds every busy row, over the smallest slot bucket that holds their
  slot budgets. The rest of the batch waits in `whole` unchanged (free rows, slots no row may write). Holding
  another prefix copies the held one back and the new one out; it happens when the load changes (an admission,
  which runs on the whole batch, or rows leaving), not on every chunk: copying a quarter of a 512-slot pool of 16
  rows out and back costs about 50 ms on a 2-core CPU, a sixth of a step.
  """

  def __init__(self, model_fn, params, cfg: InterpreterConfig, *, batch: int, vocab_size: int, pool_spec: tuple,
               rule_inputs=None, script_len: int = 0):
    self.model_fn, self.params, self.cfg, self.batch = model_fn, params, cfg, batch
    self.rule_inputs = rule_inputs  # read-only arrays of the rules (Medusa's heads), bound to params (`prepare`)
    self.script_len = bucket(script_len) if script_len > 0 else 0  # as `loop.pad_scripts` pads
    self.run_args = dict(cfg=cfg, vocab_size=vocab_size, forced=script_len > 0)
    self.pool_spec = pool_spec
    self.state = empty_batch(model_fn, params, batch, pool_spec=pool_spec, rule_inputs=rule_inputs, cfg=cfg,
                             vocab_size=vocab_size, script_len=max(script_len, 1))
    self.whole: InterpState | None = None  # the whole batch while `state` holds a prefix of it (None: `state` is it)
    self.admitted_at: list[int | None] = [None] * batch  # the batch step at each row's admission; None: free
    self.slot_limits = [0] * batch  # each busy row's slot budget (`RowBudget.slots`)

  def held(self) -> tuple[int, int]:
    """The rows and slots `state` holds."""
    return self.state.finished.shape[0], self.state.slot_valid.shape[1]

  def hold(self, rows: int, slots: int) -> None:
    """Holds `state` at the first `rows` rows and `slots` slots of the batch (all of them: the whole batch)."""
    if (rows, slots) == self.held():
      return
    shared = self.cfg.rules.shared_state
    if self.whole is not None:
      self.state, self.whole = put_part(self.whole, self.state, shared=shared), None
    if (rows, slots) != (self.batch, self.cfg.pool_slots):
      self.whole = self.state
      self.state = take_part(self.whole, rows=rows, slots=slots, shared=shared)

  def free_rows(self) -> list[int]:
    return [r for r, at in enumerate(self.admitted_at) if at is None]

  def busy_rows(self) -> list[int]:
    return [r for r, at in enumerate(self.admitted_at) if at is not None]

  def admit(self, prompts: list[list[int]], budgets: list[RowBudget], scripts=None,
            sampling: list[SamplingConfig] | None = None) -> list[int]:
    """Prefills `prompts` into free rows (as many as there are), with their per-thread `scripts` when the
    batch takes scripts, and each its own `sampling` (default: greedy; each within the batch's envelope,
    `cfg.sampling`); returns their rows, in order."""
    if not prompts:
      return []
    rows = self.free_rows()[: len(prompts)]
    self.hold(self.batch, self.cfg.pool_slots)  # admissions are compiled for the whole batch
    if len(rows) < len(prompts):
      raise PastaError(f"{len(prompts)} requests for {len(rows)} free rows")
    sampling = list(sampling or [SamplingConfig(distinct_topics=self.cfg.sampling.distinct_topics)] * len(prompts))
    outside = [s for s in sampling if not self.cfg.sampling.covers(s)]
    if outside:
      raise PastaError(f"sampling {outside[0]} is outside what this batch compiled ({self.cfg.sampling})")
    group = min(bucket(len(rows), minimum=1), self.batch)
    padded = list(prompts) + [[1]] * (group - len(rows))  # padding rows prefill one token and are dropped
    tokens, lengths = loop.pad_prompts(padded, self.cfg.pool_slots)
    script, script_len = self._scripts(scripts, len(prompts), group)
    budgets = list(budgets) + [RowBudget(0, 0, 0)] * (group - len(rows))
    rows_sampling = RowSampling.of(sampling + [SamplingConfig()] * (group - len(rows)), [0] * group)
    column = lambda name: jnp.asarray([getattr(b, name) for b in budgets], jnp.int32)
    step = int(self.state.step)
    self.state = admit(self.model_fn, self.params, self.state, jnp.asarray(tokens), jnp.asarray(lengths),
                       jnp.asarray(rows + [self.batch] * (group - len(rows)), jnp.int32), column("content"),
                       column("steps"), column("slots"), script, script_len,
                       jax.tree.map(jnp.asarray, rows_sampling), self.rule_inputs, pool_spec=self.pool_spec,
                       **self.run_args)
    for row, budget in zip(rows, budgets, strict=False):
      self.admitted_at[row] = step
      self.slot_limits[row] = budget.slots or self.cfg.pool_slots
    return rows

  def _scripts(self, scripts, count: int, group: int) -> tuple[jax.Array, jax.Array]:
    """Per-row, per-thread scripts -> [group, U, L] tokens and [group, U] lengths (L fixed at start-up)."""
    if (scripts is not None) != (self.script_len > 0):
      raise PastaError("this batch takes scripts" if self.script_len else "this batch decodes freely: no scripts")
    threads = self.cfg.max_threads
    if scripts is None:
      tokens, lens = loop.pad_scripts(None, group, threads)
    else:
      if len(scripts) != count or any(len(s) > threads for s in scripts):
        raise PastaError(f"scripts: one list per request, of at most {threads} threads")
      tokens, lens = loop.pad_scripts(list(scripts) + [[]] * (group - count), group, threads)
      if tokens.shape[2] > self.script_len:
        raise PastaError(f"a script of {int(lens.max())} tokens; this batch takes at most {self.script_len}")
      tokens = np.pad(tokens, ((0, 0), (0, 0), (0, self.script_len - tokens.shape[2])))
    return jnp.asarray(tokens), jnp.asarray(lens)

  def run(self, steps: int) -> None:
    """`steps` steps of the busy rows: only the smallest power-of-two prefix of rows that holds them all is
    computed (rows are admitted lowest first), over the smallest slot bucket that holds their slot budgets, so a
    lightly loaded batch of short requests costs what a small batch with a small pool does."""
    self._run_held(self.rows_to_run(), self.slots_to_run(), steps)

  def _run_held(self, rows: int, slots: int, steps: int) -> None:
    self.hold(rows, slots)
    self.state = run_chunk(self.model_fn, self.params, self.state, jnp.int32(steps),
                           **{**self.run_args, "cfg": dataclasses.replace(self.cfg, pool_slots=slots)})

  def slot_buckets(self) -> list[int]:
    """The pool prefixes a chunk may attend over (`slots_to_run`): a quarter of the pool (at least MIN_SLOT_BUCKET
    slots) and all of it, two programs per rows prefix (each is compiled at warm-up); all of it for rules that keep
    state of their own (it may index slots)."""
    full = self.cfg.pool_slots
    if self.state.rule_state is not None or full // 4 < MIN_SLOT_BUCKET:
      return [full]
    return [full // 4, full]

  def slots_to_run(self) -> int:
    """The slots the next chunk attends over: the smallest bucket that holds every busy row's slot budget."""
    need = max((self.slot_limits[r] for r in self.busy_rows()), default=0)
    return min(b for b in self.slot_buckets() if b >= need)

  def row_buckets(self) -> list[int]:
    """Every rows prefix a chunk may compute (`rows_to_run`) and every admission group size: the powers of
    two below the batch, and the batch."""
    return sorted({min(1 << i, self.batch) for i in range(self.batch.bit_length() + 1)})

  def compile_shapes(self, prompt_buckets=(16, 32, 64)) -> int:
    """Compiles every chunk program (one per rows and slots prefix, with the copies that hold it and its release)
    and every admission (group size x prompt bucket) ahead of use, so a batch whose load changes never stops
    mid-serving to compile. No row changes: the chunks run on free rows (no step), the releases release none and
    the admissions' rows are all padding. Returns the chunk and admission programs run."""
    if self.busy_rows():
      raise PastaError("compile_shapes runs on an idle batch")
    threads = self.cfg.max_threads
    script = jnp.zeros((1, threads, max(self.script_len, 1)), jnp.int32)
    for rows in self.row_buckets():
      for slots in self.slot_buckets():
        self._run_held(rows, slots, 0)
        self.state = release(self.state, jnp.zeros((rows,), bool))
      self.hold(self.batch, self.cfg.pool_slots)
      for prompt in (b for b in prompt_buckets if b < self.cfg.pool_slots):
        zeros = jnp.zeros((rows,), jnp.int32)
        self.state = admit(self.model_fn, self.params, self.state, jnp.ones((rows, prompt), jnp.int32),
                           jnp.ones((rows,), jnp.int32), jnp.full((rows,), self.batch, jnp.int32), zeros, zeros,
                           zeros, jnp.broadcast_to(script, (rows,) + script.shape[1:]),
                           jnp.zeros((rows, threads), jnp.int32), idle_sampling(rows), self.rule_inputs,
                           pool_spec=self.pool_spec,
                           **self.run_args)
    return len(self.row_buckets()) * (len(self.slot_buckets()) + sum(b < self.cfg.pool_slots for b in prompt_buckets))

  def rows_to_run(self) -> int:
    """The rows the next chunk computes: the smallest power-of-two prefix that holds every busy row."""
    busy = self.busy_rows()
    return min(bucket(max(busy) + 1, minimum=1), self.batch) if busy else 1

  def peek(self) -> HostView:
    return peek(self.state, self.cfg.rules.shared_state)

  def output(self, view: HostView, row: int) -> RunOutput:
    return view.run_output(row, self.cfg, self.admitted_at[row])

  def release(self, rows: list[int]) -> None:
    if not rows:
      return
    mask = np.zeros((self.held()[0],), bool)  # busy rows are within the held ones
    mask[rows] = True
    self.state = release(self.state, jnp.asarray(mask))
    for row in rows:
      self.admitted_at[row] = None
