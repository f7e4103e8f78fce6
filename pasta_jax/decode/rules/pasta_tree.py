"""PASTA x token trees ("pasta+medusa"): every live PASTA thread speculates with a small Medusa tree in the same step.

No paper has it; here it is one rule on the one step driver, because threads and tree nodes are the same kind of
object: a tree node is a one-token transient thread (as in `rules/medusa.py`), and a PASTA thread is a thread.

Lanes. The config's lanes are P thread lanes (PASTA's main and forks, `thread_lanes`) followed by P x (N - 1)
node lanes, N the tree's size: node i >= 1 of thread lane p sits on lane P + p (N - 1) + i - 1 and carries thread
id `threads` + that offset (ids below `threads` are PASTA's). The thread lanes run PASTA's own transitions
(`rules/pasta.py`: spawns at a promise's LENGTH, sync waits, closes) on a view of the first P lanes; the root of
thread p's tree is its pending token, so PASTA's feed of a thread is its tree's root.

A node's horizons are its thread's plus its ancestors' node threads: it sees what its thread sees, its ancestors,
and itself, at its thread's position + depth. So a fork's nodes never see main's later text, and main's nodes
never see a fork before the sync, by the same visibility rule.

Acceptance (greedy: lossless, the answer is PASTA's greedy answer token for token). A thread grows a tree only when
its root is answer text (no tag, end id, `<async>`, closing fork, or main inside a promise's topic), and a node
holding a tag or end id is never accepted, so every PASTA event (a promise's LENGTH, `<sync/>`, `</async>`, an end)
arrives as the last token of a step, the thread's new pending token, and runs PASTA's transitions as always. Each
thread keeps its longest accepted path: its slots join the thread, the rest are freed (slots are reused lowest
first, so rejected nodes do not fill the pool). Each path lane records its next token, in lane order: the thread's
root lane records the path's first token, so the thread's real pending token (the path's last next token) waits
in the rule state until the next step (`pending`, `stashed`).

The heads run once per step on the hidden state at each fed thread's last path node (rows bucketed like the lanes);
near the content budget or a full pool no thread grows a tree, so the step is a plain PASTA step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.constraints import AllowedTokens, language_ids
from pasta_jax.decode.pool import inserted_rows, lowest_free_slots, usable_slots, write_slots
from pasta_jax.decode.rules.base import InterpreterConfig, Rules, StepFeed, bucket_index, lane_buckets
from pasta_jax.decode.rules.pasta import PastaRules, apply_samples, apply_spawn, plan_feeds, release_sync
from pasta_jax.decode.state import FREE, RUNNING, InterpState
from pasta_jax.decode.tree import TokenTree
from pasta_jax.model import medusa
from pasta_jax.model.output import ModelOutput
from pasta_jax.visibility import UNBOUNDED

LANE_FIELDS = ("status", "thread", "token", "position", "horizon", "depth")  # the thread table's [B, T, ...] arrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ThreadTrees:
  """Per request and thread lane: the next trees' candidates, this step's paths, the stashed pending tokens."""

  candidates: jax.Array  # [B, P, H, k] int32 each head's top tokens at the thread's last path node
  have_candidates: jax.Array  # [B, P] bool
  pending: jax.Array  # [B, P] int32 the thread's pending token while its root lane holds the record of a path
  pending_pos: jax.Array  # [B, P] int32 its position
  stashed: jax.Array  # [B, P] bool
  path: jax.Array  # [B, L] bool this step's accepted paths (root lanes and node lanes)
  bonus: jax.Array  # [B, P] int32 the next token at each thread's last path node
  accepted: jax.Array  # [B, P] int32 nodes past the root on each thread's path
  tree_steps: jax.Array  # [B] int32 thread-steps that fed a tree
  tree_tokens: jax.Array  # [B] int32 tokens those thread-steps wrote (root + accepted nodes)
  tree_nodes: jax.Array  # [B] int32 nodes fed past the roots
  inputs: dict  # read-only: heads, drafted rows


@dataclasses.dataclass(frozen=True)
class PastaTreeRules(PastaRules):
  """PASTA's rules with a Medusa tree of `tree.size` nodes on every live thread (greedy acceptance)."""

  name: ClassVar[str] = "pasta+medusa"
  shared_state: ClassVar[tuple[str, ...]] = ("inputs",)
  tree: TokenTree = TokenTree(((),))
  thread_lanes: int = 8  # P: PASTA's lanes (main + forks at once)
  threads: int = 64  # PASTA's thread ids; node threads take the ids above
  num_heads: int = 4
  top_k: int = 8
  softcap: float | None = None

  # --- shapes --------------------------------------------------------------------------------------
  @property
  def node_lanes(self) -> int:
    return self.thread_lanes * (self.tree.size - 1)

  def validate(self, cfg: InterpreterConfig) -> None:
    PastaRules.validate(self, cfg)
    if cfg.lanes != self.thread_lanes * self.tree.size or cfg.max_threads != self.threads + self.node_lanes:
      raise ValueError(f"{self.thread_lanes} thread lanes with {self.tree.size}-node trees need lanes = "
                       f"{self.thread_lanes * self.tree.size} and max_threads = {self.threads + self.node_lanes}, got "
                       f"lanes={cfg.lanes}, max_threads={cfg.max_threads}")
    self.tree.check_heads(self.num_heads, self.top_k)

  @functools.cached_property
  def lane_grid(self) -> np.ndarray:
    """[P, N] the lane of node i of thread lane p (node 0, the root, is the thread lane itself)."""
    p, n = self.thread_lanes, self.tree.size
    nodes = p + np.arange(p)[:, None] * (n - 1) + np.arange(n - 1)[None, :]
    return np.concatenate([np.arange(p)[:, None], nodes], axis=1).astype(np.int32)

  @functools.cached_property
  def base_lane(self) -> np.ndarray:
    """[L] the thread lane each lane belongs to."""
    base = np.zeros(self.thread_lanes * self.tree.size, np.int32)
    base[self.lane_grid.reshape(-1)] = np.repeat(np.arange(self.thread_lanes), self.tree.size)
    return base

  @functools.cached_property
  def node_index(self) -> np.ndarray:
    """[L] the tree node each lane holds (0 on thread lanes)."""
    node = np.zeros(self.thread_lanes * self.tree.size, np.int32)
    node[self.lane_grid.reshape(-1)] = np.tile(np.arange(self.tree.size), self.thread_lanes)
    return node

  def node_horizon_columns(self) -> np.ndarray:
    """[L - P, U] bool: the node threads each node lane sees whole (its ancestors' and its own)."""
    p = self.thread_lanes
    sees = np.zeros((self.node_lanes, self.threads + self.node_lanes), bool)
    for lane in range(p, p + self.node_lanes):
      base, node = self.base_lane[lane], self.node_index[lane]
      for j in np.flatnonzero(self.tree.ancestors[node][1:]) + 1:
        sees[lane - p, self.threads + self.lane_grid[base, j] - p] = True
    return sees

  def thread_cfg(self, cfg: InterpreterConfig) -> InterpreterConfig:
    """The config PASTA's transitions see: the thread lanes and PASTA's thread ids."""
    return _thread_cfg(cfg, self.thread_lanes, self.threads)

  def thread_view(self, state: InterpState) -> InterpState:
    return dataclasses.replace(state, **{f: getattr(state, f)[:, :self.thread_lanes] for f in LANE_FIELDS})

  def merge_view(self, state: InterpState, view: InterpState) -> InterpState:
    """`view`'s state with the thread lanes put back into `state`'s full lane arrays."""
    return dataclasses.replace(view, **{f: getattr(state, f).at[:, :self.thread_lanes].set(getattr(view, f))
                                        for f in LANE_FIELDS})

  # --- state ---------------------------------------------------------------------------------------
  def bind_inputs(self, rule_inputs, params):
    """The heads rank the draft vocabulary's rows of the model's tied output head, gathered here once."""
    if rule_inputs is None:
      return rule_inputs
    return medusa.bind_rows(rule_inputs, params["params"]["embedder"])

  def init_rule_state(self, prompt_tokens, lengths, rule_inputs, cfg: InterpreterConfig) -> ThreadTrees:
    if rule_inputs is None or "heads" not in rule_inputs or "drafted" not in rule_inputs:
      raise ValueError("pasta+medusa decoding needs rule_inputs={'heads': Medusa heads, 'drafted': their rows}")
    batch, p = lengths.shape[0], self.thread_lanes
    zeros = jnp.zeros((batch, p), jnp.int32)
    count = jnp.zeros((batch,), jnp.int32)
    return ThreadTrees(candidates=jnp.zeros((batch, p, self.num_heads, self.top_k), jnp.int32),
                       have_candidates=jnp.zeros((batch, p), bool), pending=zeros, pending_pos=zeros,
                       stashed=jnp.zeros((batch, p), bool), path=jnp.zeros((batch, cfg.lanes), bool), bonus=zeros,
                       accepted=zeros, tree_steps=count, tree_tokens=count, tree_nodes=count,
                       inputs=dict(rule_inputs))

  def model_extras(self, state: InterpState, cfg: InterpreterConfig, num_q: int) -> dict:
    del state, cfg, num_q
    return {"return_hidden": True}

  # --- before the model: PASTA's feeds, then the trees ---------------------------------------------
  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    d: ThreadTrees = state.rule_state
    p = self.thread_lanes
    state = dataclasses.replace(  # the threads' real pending tokens (their root lanes held last step's records)
        state, token=state.token.at[:, :p].set(jnp.where(d.stashed, d.pending, state.token[:, :p])),
        position=state.position.at[:, :p].set(jnp.where(d.stashed, d.pending_pos, state.position[:, :p])))
    tcfg = self.thread_cfg(cfg)
    free = usable_slots(state).sum(axis=1)
    view = self.thread_view(state)
    plan = plan_feeds(view, tcfg, length_table, free_slots=free)
    spawned_thread = view.next_thread
    view = release_sync(apply_spawn(view, plan, tcfg), plan)
    inserted = inserted_rows(view, plan.spawn_lane[:, None])  # the fork's `<async>`, fed this step
    state = self.merge_view(state, view)
    grow = self.growing_threads(state, view, plan.feed, free, cfg)
    state, node_feed = self.lay_out_nodes(state, view, grow, cfg)
    feed = jnp.concatenate([plan.feed, node_feed], axis=1)
    slots = lowest_free_slots(feed, state, cfg.pool_slots)
    state = write_slots(state, feed, slots)  # thread lanes first: main writes at next_slot, as apply_spawn assumes
    return state, StepFeed(feed, slots, inserted, plan.spawn[:, None], (plan, spawned_thread))

  def growing_threads(self, state: InterpState, view: InterpState, fed: jax.Array, free: jax.Array,
                      cfg: InterpreterConfig) -> jax.Array:
    """[B, P] threads that feed a tree: fed, with an answer-text root, candidates, and room for every node."""
    d: ThreadTrees = state.rule_state
    language = language_ids(cfg.vocab)
    in_topic = (jnp.arange(self.thread_lanes) == 0)[None, :] & state.in_promise[:, None]
    grow = fed & d.have_candidates & (view.status == RUNNING) & ~jnp.isin(view.token, language) & ~in_topic
    writes = fed.sum(axis=1) + grow.sum(axis=1) * (self.tree.size - 1)
    room = writes <= free
    if cfg.max_content:  # near the budget, plain steps: a tree step records up to its depth more per thread
      left = state.content_budget - state.content
      most = fed.sum(axis=1) + grow.sum(axis=1) * self.tree.max_depth
      room &= (state.content_budget == 0) | (left >= most)
    return grow & room[:, None]

  def lay_out_nodes(self, state: InterpState, view: InterpState, grow: jax.Array, cfg: InterpreterConfig):
    """Node lanes take their candidates, positions, node threads and horizons; returns (state, [B, L-P] feed)."""
    d: ThreadTrees = state.rule_state
    p = self.thread_lanes
    base, node = self.base_lane[p:], self.node_index[p:]
    depth, rank = self.tree.depth[node], self.tree.rank[node]
    node_feed = grow[:, base]
    token = d.candidates[:, base, depth - 1, rank]  # [B, L-P]
    horizon = jnp.where(jnp.asarray(self.node_horizon_columns())[None], UNBOUNDED, view.horizon[:, base, :])
    node_threads = jnp.broadcast_to(self.threads + jnp.arange(self.node_lanes), token.shape)
    state = dataclasses.replace(
        state, token=state.token.at[:, p:].set(token.astype(jnp.int32)),
        position=state.position.at[:, p:].set(view.position[:, base] + depth[None, :]),
        thread=state.thread.at[:, p:].set(node_threads.astype(jnp.int32)),
        horizon=state.horizon.at[:, p:].set(horizon),
        status=state.status.at[:, p:].set(jnp.where(node_feed, RUNNING, FREE)))
    return state, node_feed

  # --- the model's output: each thread's path --------------------------------------------------------
  def allowed(self, state: InterpState, rows_lane: jax.Array, logits: jax.Array, cfg: InterpreterConfig):
    """A node row samples under its thread's constraints (main's or a fork's)."""
    tables = AllowedTokens.build(cfg.vocab, logits.shape[-1])
    is_main = jnp.asarray(self.base_lane)[rows_lane] == 0
    return tables.for_rows(is_main, state.in_promise[:, None]), jnp.zeros(rows_lane.shape, bool)

  def select_tokens(self, state: InterpState, rows_lane, row_ok, logits, cfg: InterpreterConfig,
                    model_out: ModelOutput | None = None):
    state, chosen, refused = Rules.select_tokens(self, state, rows_lane, row_ok, logits, cfg)
    if model_out is None:  # after prefill: main's first token
      return state, chosen, refused
    d: ThreadTrees = state.rule_state
    batch, num_q = chosen.shape
    b = jnp.arange(batch)[:, None]
    scatter = jnp.where(row_ok, rows_lane, cfg.lanes)
    lane_choice = jnp.full((batch, cfg.lanes), -1, jnp.int32).at[b, scatter].set(chosen, mode="drop")
    lane_row = jnp.zeros((batch, cfg.lanes), jnp.int32).at[b, scatter].set(jnp.arange(num_q), mode="drop")
    lane_fed = jnp.zeros((batch, cfg.lanes), bool).at[b, scatter].set(True, mode="drop")
    grid = jnp.asarray(self.lane_grid)
    node_choice, node_fed = lane_choice[:, grid], lane_fed[:, grid]  # [B, P, N]
    accepted = self.accepted_nodes(state.token[:, grid], node_choice, node_fed, cfg)
    depth = jnp.asarray(self.tree.depth)
    n = self.tree.size
    last = jnp.argmax(jnp.where(accepted, depth * (n + 1) + (n - jnp.arange(n)), -1), axis=-1)  # [B, P]
    on_path = jnp.asarray(self.tree.ancestors)[last] & node_fed  # [B, P, N]
    path = jnp.zeros((batch, cfg.lanes), bool).at[b[:, :, None], grid[None]].set(on_path)
    bonus = jnp.take_along_axis(node_choice, last[..., None], axis=-1)[..., 0]
    fed = node_fed[:, :, 0]
    last_lane = grid[jnp.arange(self.thread_lanes)[None, :], last]  # [B, P]
    candidates = self.thread_candidates(d, model_out.head_input, lane_row[b, last_lane], bonus, fed, num_q)
    grew = jnp.any(node_fed[:, :, 1:], axis=-1)
    new = dataclasses.replace(
        d, path=path, bonus=bonus, accepted=depth[last] * fed,
        candidates=jnp.where(fed[..., None, None], candidates, d.candidates), have_candidates=d.have_candidates | fed,
        tree_steps=d.tree_steps + grew.sum(axis=1), tree_tokens=d.tree_tokens + ((depth[last] + 1) * grew).sum(axis=1),
        tree_nodes=d.tree_nodes + node_fed[:, :, 1:].sum(axis=(1, 2)))
    return dataclasses.replace(state, rule_state=new), chosen, refused

  def accepted_nodes(self, node_token, node_choice, node_fed, cfg: InterpreterConfig) -> jax.Array:
    """[B, P, N] nodes whose whole path is accepted: each node's token is its parent's choice (greedy), and
    answer text (a tag or end id ends a path: it arrives as the step's last token, PASTA's event)."""
    parent, depth = np.maximum(self.tree.parent, 0), self.tree.depth
    language = language_ids(cfg.vocab)
    match = (node_token == node_choice[:, :, parent]) & node_fed & ~jnp.isin(node_token, language)
    accepted = (jnp.arange(self.tree.size) == 0) & node_fed
    for level in range(1, self.tree.max_depth + 1):  # parents come first: one pass per depth
      accepted |= (depth == level) & match & accepted[:, :, parent]
    return accepted

  def thread_candidates(self, d: ThreadTrees, hidden, rows, bonus, fed, num_q: int) -> jax.Array:
    """[B, P, H, k] the heads' top tokens at each fed thread's last path node (hidden [B, Q, D]; rows [B, P] its
    row; bonus [B, P] the base model's choice there). The heads run on as many rows as the most threads any
    request fed (a lane bucket up to min(P, Q): no more threads than rows can feed), fed threads first."""
    b = jnp.arange(fed.shape[0])[:, None]
    order = jnp.argsort(~fed, axis=1, stable=True)  # fed threads first

    def heads_on(count: int):  # the heads cost most of a row each (a draft-vocabulary head apiece): run few
      pick = order[:, :count]
      top = medusa.rule_top_tokens(d.inputs, hidden[b, rows[b, pick]], bonus[b, pick], self.top_k,
                                   self.softcap)  # [B, count, H, k]
      return d.candidates.at[b, order[:, :count]].set(top)

    sizes = lane_buckets(min(self.thread_lanes, num_q))
    return jax.lax.switch(bucket_index(fed, sizes), [functools.partial(heads_on, s) for s in sizes])

  # --- after: PASTA's transitions on the bonus tokens, records of the paths ---------------------------
  def after_model(self, state: InterpState, step: StepFeed, sampled, cfg: InterpreterConfig, length_table):
    plan, spawned_thread = step.plan
    d: ThreadTrees = state.rule_state
    p = self.thread_lanes
    b = jnp.arange(sampled.shape[0])[:, None]
    root_pos = state.position[:, :p]
    view, recorded = apply_samples(self.thread_view(state), plan, jnp.where(plan.feed, d.bonus, sampled[:, :p]),
                                   self.thread_cfg(cfg), length_table, spawned_thread)
    grew = recorded & (d.accepted > 0)
    view = dataclasses.replace(view, position=view.position + jnp.where(recorded, d.accepted, 0))
    stash = dataclasses.replace(d, pending=jnp.where(grew, view.token, d.pending),
                                pending_pos=jnp.where(grew, view.position, d.pending_pos), stashed=grew)
    view = dataclasses.replace(view, token=jnp.where(grew, sampled[:, :p], view.token),  # records: the path's first
                               position=jnp.where(grew, root_pos + 1, view.position))
    state = self.merge_view(state, view)
    path = d.path & step.feed
    nodes = path.at[:, :p].set(False)
    base = jnp.asarray(self.base_lane)
    thread_id = view.thread[:, base]  # [B, L] each lane's PASTA thread
    closes = (base > 0)[None, :] & jnp.isin(sampled, jnp.asarray(cfg.vocab.eos_ids))  # a fork's end is `</async>`
    keep = jnp.where(path, step.slots, cfg.pool_slots)
    drop = jnp.where(step.feed & ~path, step.slots, cfg.pool_slots)
    state = dataclasses.replace(
        state, rule_state=stash,
        slot_owner=state.slot_owner.at[b, keep].set(thread_id, mode="drop"),  # each path joins its thread
        slot_valid=state.slot_valid.at[b, drop].set(False, mode="drop"),  # the rest of the trees are released
        token=jnp.where(nodes, jnp.where(closes, cfg.vocab.async_close, sampled), state.token),
        position=jnp.where(nodes, state.position + 1, state.position),
        thread=jnp.where(nodes, thread_id, state.thread),
        status=state.status.at[:, p:].set(FREE))
    return state, jnp.concatenate([recorded, nodes[:, p:]], axis=1)

  def host_outputs(self, rule_state: Any, request: int) -> dict:
    d = rule_state
    steps = int(d.tree_steps[request])
    return {"tree_steps": steps, "tree_tokens": int(d.tree_tokens[request]),
            "accept_length": int(d.tree_tokens[request]) / max(steps, 1),
            "tree_nodes": int(d.tree_nodes[request])}


@functools.lru_cache(maxsize=64)
def _thread_cfg(cfg: InterpreterConfig, lanes: int, threads: int) -> InterpreterConfig:
  return dataclasses.replace(cfg, lanes=lanes, max_threads=threads, rules=PastaRules())
