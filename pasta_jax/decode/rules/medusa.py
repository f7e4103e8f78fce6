"""Medusa tree speculation, and ProPD's dynamic tree size, as rules on the one step driver (paper 004).

Each step one request feeds a token tree (`decode.tree`): the root is main's pending token (certain), and
node (r_1..r_d) the rank-r_d candidate of Medusa head d-1 from the last step. Lane i carries node i as a
one-token transient thread i (the root is main): it sees main's cache and its ancestors, at position
p + depth, through the one visibility rule, in the one model call, which also runs the heads on every
node. Then, on device:

  acceptance   greedy: a node is accepted when its token is its parent's argmax (lossless: the output is
               plain greedy decoding token for token); typical (Medusa): when the parent's probability of
               it exceeds min(epsilon, delta * exp(-entropy)). The longest accepted path wins; nodes holding
               an end id or past the content budget are never accepted;
  records      each lane on the path records its own next token (the next path node's, and at the last
               node the base model's bonus token), so a step writes depth + 1 tokens, in lane order;
  the pool     the path's slots become main's, every other node's slot is freed (lowest-free reuse);
  the heads    the last path node's head candidates build the next tree.

ProPD's dynamic tree size (`dynamic=True`): each step, one prefix of the tree for the batch, maximising
sum_b E_b(s) / T(s) among the lane buckets s = 1, 2, 4, ..., N: E_b(s) is request b's expected accepted
length from the heads' top-k hit rates (a calibrated prior, updated online from the batch's and then the
request's own steps), and T(s) the step time of size s, measured in a calibration run on the device and batch
size (`rule_inputs["latency"]`, `speculation.step_times`): the loop runs on device, so times are measured between
host calls.
Size 1 is the root alone, a plain step, and while no request of the batch plans a tree ProPD runs plain decoding's
own step (`cheaper_steps`, `PlainSteps`, in a loop of its own inside the tree steps' loop): main's lane alone, one
row per request, its K/V written in place, no lane-count switch, of the tree's bookkeeping a few counters. So T(1) is
a plain step's time and ProPD falls back to plain decoding where no tree pays for itself. Now and then head 0 runs
anyway (a probe, in a conditional), and the next plain token checks its candidates, so the hit rates keep moving and
ProPD takes trees up again when the heads start to hit: the plain step that finds a tree worth it runs every head,
and the loop goes back to tree steps. Probes come `probe_every` steps apart, twice as far apart after each miss of
head 0 (up to `probe_max`), and at once after a hit (`probe_schedule`).

ProPD's early pruning (`prune=EarlyPrune(...)`, `rules/pruning.py`): after a few layers an early head lists
each node's likely successors; nodes not on their parent's list, and their subtrees, leave the model call, so
only M of a bucket's Q rows run the deep layers and the output head (`model.gemma.RowSelect`). A pruned node is
never accepted, so greedy acceptance stays lossless.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pasta_jax.decode.pool import lowest_free_slots, usable_slots, write_slots
from pasta_jax.decode.rules import pruning
from pasta_jax.decode.rules.base import CheaperSteps, InterpreterConfig, Rules, StepFeed, lane_buckets
from pasta_jax.decode.rules.pasta_tree import LANE_FIELDS
from pasta_jax.decode.rules.sequential import SequentialRules
from pasta_jax.decode.state import DONE, FREE, RUNNING, InterpState
from pasta_jax.decode.tree import TokenTree
from pasta_jax.model import medusa
from pasta_jax.model.gemma import RowSelect
from pasta_jax.model.output import ModelOutput
from pasta_jax.visibility import HIDDEN, UNBOUNDED

ACCEPTANCE = ("greedy", "typical")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeState:
  """Per request: the next tree's inputs, this step's path, and the counts behind ProPD and the reports."""

  candidates: jax.Array  # [B, H, k] int32 each head's top tokens at the last path node
  have_candidates: jax.Array  # [B] bool (False until the first tree step: the prefill has no heads)
  root_token: jax.Array  # [B] int32 main's pending token (the next tree's root)
  root_pos: jax.Array  # [B] int32 its position
  path: jax.Array  # [B, N] bool this step's accepted path (lanes)
  hits: jax.Array  # [B, H, k] float32 steps where head h's rank-r token was right (observed steps only)
  trials: jax.Array  # [B, H] float32 steps where head h's target was observed (its depth was reached)
  tree_steps: jax.Array  # [B] int32 steps that fed a tree
  written: jax.Array  # [B] int32 tokens those steps wrote (accept length summed)
  size_counts: jax.Array  # [B, n_sizes] int32 how often each tree size was chosen
  tree_nodes: jax.Array  # [B] int32 nodes fed past the root (candidates)
  plain_steps: jax.Array  # [B] int32 of the steps that fed, those that ran plain decoding's step (`PlainSteps`)
  probes: jax.Array  # [B] int32 probe steps (head 0 alone, no tree planned) among them
  probe_gap: jax.Array  # [B] int32 steps from the next probe to the one after it (`probe_schedule`)
  next_probe: jax.Array  # [B] int32 the step of the request's next probe
  pruned: jax.Array  # [B] int32 of those, nodes early pruning cut before the deep layers
  inputs: dict  # read-only: heads, prior hit rates [H, k], latency [n_sizes] (ProPD)


@dataclasses.dataclass(frozen=True)
class MedusaRules(SequentialRules):
  """Token-tree speculation with Medusa heads; `dynamic=True` is ProPD's dynamic tree size."""

  name: ClassVar[str] = "medusa"
  shared_state: ClassVar[tuple[str, ...]] = ("inputs",)
  tree: TokenTree = TokenTree(((),))
  num_heads: int = 4
  top_k: int = 8  # candidates kept per head (the tree reads ranks below it)
  acceptance: str = "greedy"
  typical_epsilon: float = 0.09  # Medusa's posterior threshold
  typical_delta: float = 0.3  # Medusa's posterior alpha (sqrt of epsilon)
  dynamic: bool = False  # ProPD: pick the tree prefix each step (needs rule_inputs["latency"])
  prior_weight: float = 20.0  # pseudo-steps behind the calibrated hit rates (ProPD's online estimate)
  probe_every: int = 4  # ProPD: while no tree is planned, head 0 still runs after this many steps (0: never)...
  probe_max: int = 32  # ...and after twice as many for each probe in a row that head 0 misses, up to this many
  softcap: float | None = None  # the model's final logit soft cap, which the heads' logits take too
  prune: pruning.EarlyPrune | None = None  # ProPD's early pruning (None: every node runs every layer)

  def validate(self, cfg: InterpreterConfig) -> None:
    Rules.validate(self, cfg)
    if cfg.lanes != self.tree.size or cfg.max_threads < self.tree.size:
      raise ValueError(f"a {self.tree.size}-node tree needs lanes = {self.tree.size} and max_threads >= it, got "
                       f"lanes={cfg.lanes}, max_threads={cfg.max_threads}")
    self.tree.check_heads(self.num_heads, self.top_k)
    if self.acceptance not in ACCEPTANCE:
      raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")

  @property
  def sizes(self) -> tuple[int, ...]:
    """The tree sizes ProPD chooses among: the lane buckets up to the whole tree."""
    return lane_buckets(self.tree.size)

  # --- state ---------------------------------------------------------------------------------------
  def bind_inputs(self, rule_inputs, params):
    """The heads rank the draft vocabulary's rows of the model's tied output head, gathered here once; early
    pruning without a trained early head reads the model's final norm (the logit lens)."""
    if rule_inputs is None:
      return rule_inputs
    bound = medusa.bind_rows(rule_inputs, params["params"]["embedder"])
    if self.prune is not None and "early" not in bound:
      bound["early"] = pruning.logit_lens_head(params["params"]["final_norm"]["scale"])
    if self.prune is not None and self.prune.top_k > bound["drafted"].shape[0]:
      raise ValueError(f"early pruning keeps the top {self.prune.top_k} of a draft vocabulary of "
                       f"{bound['drafted'].shape[0]} tokens")
    return bound

  def init_rule_state(self, prompt_tokens, lengths, rule_inputs, cfg: InterpreterConfig) -> TreeState:
    if rule_inputs is None or "heads" not in rule_inputs:
      raise ValueError("medusa decoding needs rule_inputs={'heads': Medusa heads, ...} (model/medusa.py)")
    if self.dynamic and "latency" not in rule_inputs:
      raise ValueError("dynamic tree sizes (ProPD) need rule_inputs['latency']: seconds per step of each size")
    batch, h, k = lengths.shape[0], self.num_heads, self.top_k
    rates = rule_inputs.get("rates", jnp.zeros((h, k), jnp.float32))
    return TreeState(candidates=jnp.zeros((batch, h, k), jnp.int32), have_candidates=jnp.zeros((batch,), bool),
                     root_token=jnp.zeros((batch,), jnp.int32), root_pos=lengths.astype(jnp.int32),
                     path=jnp.zeros((batch, cfg.lanes), bool), hits=jnp.zeros((batch, h, k), jnp.float32),
                     trials=jnp.zeros((batch, h), jnp.float32), tree_steps=jnp.zeros((batch,), jnp.int32),
                     written=jnp.zeros((batch,), jnp.int32),
                     size_counts=jnp.zeros((batch, len(self.sizes)), jnp.int32),
                     tree_nodes=jnp.zeros((batch,), jnp.int32), pruned=jnp.zeros((batch,), jnp.int32),
                     plain_steps=jnp.zeros((batch,), jnp.int32), probes=jnp.zeros((batch,), jnp.int32),
                     probe_gap=jnp.full((batch,), self.probe_every, jnp.int32),
                     next_probe=jnp.zeros((batch,), jnp.int32),
                     inputs={**rule_inputs, "rates": jnp.asarray(rates, jnp.float32)})

  def model_extras(self, state: InterpState, cfg: InterpreterConfig, num_q: int) -> dict:
    """The model returns its hidden states too: the heads run on the path's last node only, after acceptance.
    With early pruning, a bucket of num_q rows sends only `prune.rows_kept(num_q)` past the early layer."""
    del cfg
    keep = num_q if self.prune is None else self.prune.rows_kept(num_q)
    if keep == num_q:
      return {"return_hidden": True}
    inputs, prune = state.rule_state.inputs, self.prune
    parent, depth = self.tree.parent[:num_q], self.tree.depth[:num_q]

    def choose(x, tokens):
      top = pruning.early_top_tokens(inputs["early"], x, inputs["drafted"], inputs["heads"].get("vocab"),
                                     prune.top_k, prune.eps)
      return pruning.first_rows(pruning.surviving_nodes(top, tokens, parent, depth), keep)

    return {"return_hidden": True, "row_select": RowSelect(prune.layer, keep, choose)}

  @staticmethod
  def with_latency(state: InterpState, table) -> InterpState:
    """`state` with ProPD's step-time table [n_sizes] replaced (same shape: no recompile); for callers that
    measure step times between chunks (`pasta_jax/serve/propd.py`)."""
    d = state.rule_state
    latency = jnp.asarray(table, d.inputs["latency"].dtype).reshape(d.inputs["latency"].shape)
    return dataclasses.replace(state, rule_state=dataclasses.replace(d, inputs={**d.inputs, "latency": latency}))

  # --- before the model: lay out the tree -----------------------------------------------------------
  def tree_size(self, d: TreeState, live: jax.Array) -> jax.Array:
    """[B] nodes each request feeds: the whole tree, or ProPD's choice; the root alone before candidates."""
    size = self.planned_size(d, live) if self.dynamic else jnp.full(live.shape, self.tree.size, jnp.int32)
    return jnp.where(d.have_candidates, size, 1).astype(jnp.int32)

  def planned_size(self, d: TreeState, live: jax.Array) -> jax.Array:
    """[B] ProPD's choice, one for the batch: the size s maximising the `live` requests' expected tokens over
    the step's time, sum_b E_b(s) / T(s), were the heads' candidates at hand. One size, since every row of a
    step computes the largest tree of the batch and T(s) is timed for the whole batch."""
    expected = jnp.cumsum(self.node_probabilities(d), axis=1)  # [B, N] E(prefix of i + 1 nodes)
    sizes = jnp.asarray(self.sizes)
    tokens = jnp.sum(jnp.where(live[:, None], expected[:, sizes - 1], 0.0), axis=0)  # [n_sizes]
    return jnp.full(live.shape, sizes[jnp.argmax(tokens / d.inputs["latency"])], jnp.int32)

  def hit_rates(self, d: TreeState) -> jax.Array:
    """[B, H, k] each head's rank hit rates, shrunk twice: the calibrated prior, moved by the whole batch's
    steps (every request runs the same heads, so B requests learn B times faster how far this run's prompts
    are from the calibration set), then by the request's own steps."""
    w = self.prior_weight
    batch = (w * d.inputs["rates"] + d.hits.sum(axis=0)) / (w + d.trials.sum(axis=0)[:, None])  # [H, k]
    return (w * batch[None] + d.hits) / (w + d.trials[:, :, None])

  def node_probabilities(self, d: TreeState) -> jax.Array:
    """[B, N] probability that each node is accepted (products of hit rates along its path)."""
    rates = self.hit_rates(d)
    depth, rank, parent = self.tree.depth, self.tree.rank, self.tree.parent
    node_rate = rates[:, np.maximum(depth - 1, 0), rank]  # [B, N]
    prob = jnp.ones_like(node_rate)
    for level in range(1, self.tree.max_depth + 1):  # parents come first: one pass per depth
      at = depth == level
      prob = jnp.where(at[None], prob[:, np.maximum(parent, 0)] * node_rate, prob)
    return prob

  def tree_horizon(self, max_threads: int) -> jax.Array:
    """[N, U] horizons: node i sees main (thread 0) and the threads of its ancestors and itself, whole."""
    sees = np.full((self.tree.size, max_threads), HIDDEN, np.int32)
    sees[:, : self.tree.size][self.tree.ancestors] = UNBOUNDED
    sees[:, 0] = UNBOUNDED
    return jnp.asarray(sees)

  def next_step(self, state: InterpState, cfg: InterpreterConfig):
    """(running, at_end, usable) of the next step: [B] main runs, [B] its pending token (the next root) is an end id,
    [B, S] the free slots it may write."""
    running = state.live & (state.status[:, 0] == RUNNING)
    at_end = running & jnp.isin(state.rule_state.root_token, jnp.asarray(cfg.vocab.eos_ids))
    return running, at_end, usable_slots(state)

  def next_sizes(self, state: InterpState, cfg: InterpreterConfig) -> jax.Array:
    """[B] the nodes each request feeds next step (as many as the pool has room for)."""
    running, at_end, usable = self.next_step(state, cfg)
    return jnp.minimum(self.tree_size(state.rule_state, running & ~at_end), usable.sum(axis=1))

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    d: TreeState = state.rule_state
    running, at_end, usable = self.next_step(state, cfg)
    free = usable.sum(axis=1)
    size = self.next_sizes(state, cfg)
    out_of_room = running & ~at_end & (free == 0)
    lanes = jnp.arange(cfg.lanes)
    feed = (running & ~at_end)[:, None] & (lanes[None, :] < size[:, None])
    depth, rank = jnp.asarray(self.tree.depth), jnp.asarray(self.tree.rank)
    heads_pick = d.candidates[:, jnp.maximum(depth - 1, 0), rank]  # [B, N]
    token = jnp.where(lanes[None, :] == 0, d.root_token[:, None], heads_pick)
    horizon = jnp.broadcast_to(self.tree_horizon(cfg.max_threads), state.horizon.shape)
    state = dataclasses.replace(
        state, token=token.astype(jnp.int32), position=(d.root_pos[:, None] + depth[None, :]).astype(jnp.int32),
        thread=jnp.broadcast_to(lanes, token.shape).astype(jnp.int32), horizon=horizon,
        status=jnp.where(lanes[None, :] == 0, state.status[:, :1], jnp.where(feed, RUNNING, FREE)))
    slots = lowest_free_slots(feed, state, cfg.pool_slots)
    state = write_slots(state, feed, slots)
    size_seen = (jnp.asarray(self.sizes)[None, :] == size[:, None]) & feed[:, :1]
    state = dataclasses.replace(state, rule_state=dataclasses.replace(
        d, size_counts=d.size_counts + size_seen.astype(jnp.int32)))
    batch = feed.shape[0]
    none = (jnp.zeros((batch, 0, 5), jnp.int32), jnp.zeros((batch, 0), bool))
    return state, StepFeed(feed, slots, *none, (at_end, out_of_room, slots))

  # --- the model's output: accept a path ------------------------------------------------------------
  def select_tokens(self, state: InterpState, rows_lane, row_ok, logits, cfg: InterpreterConfig,
                    model_out: ModelOutput | None = None):
    state, chosen, refused = super().select_tokens(state, rows_lane, row_ok, logits, cfg)  # each node's next token
    d: TreeState = state.rule_state
    if model_out is None:  # after prefill: main's first token is the first root
      return dataclasses.replace(state, rule_state=dataclasses.replace(d, root_token=chosen[:, 0])), chosen, refused
    hidden = model_out.head_input  # [B, Q, D]
    kept = row_ok if model_out.kept is None else model_out.kept  # the rows early pruning let through
    b = jnp.arange(logits.shape[0])[:, None]
    num_q = logits.shape[1]  # feeders are lanes 0..size-1, so row q is lane q
    depth, parent = jnp.asarray(self.tree.depth[:num_q]), jnp.asarray(np.maximum(self.tree.parent[:num_q], 0))
    node_token = state.token[b, rows_lane]
    accepted = self.accepted_nodes(state, node_token, chosen, logits, row_ok & kept, depth, parent, cfg)
    score = jnp.where(accepted, depth[None, :] * (num_q + 1) + (num_q - jnp.arange(num_q))[None, :], -1)
    last = jnp.argmax(score, axis=1)  # deepest accepted node; among equals the likelier (earlier) one
    on_path = jnp.asarray(self.tree.ancestors[:num_q, :num_q])[last] & row_ok  # [B, Q]
    path = jnp.zeros((logits.shape[0], cfg.lanes), bool).at[:, :num_q].set(on_path)
    fed = row_ok[:, 0] & state.live
    new = dataclasses.replace(
        d, root_token=jnp.where(fed, chosen[b[:, 0], last], d.root_token),
        root_pos=jnp.where(fed, d.root_pos + depth[last] + 1, d.root_pos), path=path,
        tree_steps=d.tree_steps + fed, written=d.written + jnp.where(fed, depth[last] + 1, 0),
        tree_nodes=d.tree_nodes + jnp.sum(row_ok[:, 1:], axis=1), pruned=d.pruned + jnp.sum(row_ok & ~kept, axis=1))
    new = self.count_hits(new, d, node_token, on_path, depth, chosen[b[:, 0], last], depth[last], fed)
    new = self.next_candidates(new, hidden[b[:, 0], last], new.root_token, fed, state.step)
    return dataclasses.replace(state, rule_state=new), chosen, refused

  def next_candidates(self, new: TreeState, hidden, root, fed, step) -> TreeState:
    """`new` with the heads' candidates for the next step, read at each request's last path node (hidden [B, D];
    root [B]: the base model's choice there, the next root). Medusa: every step. ProPD: every head when some request
    plans a tree for its next step; head 0 alone on a probe step (`probing`), whose next step is a plain one and
    observes head 0's guess only (`count_hits`); no head otherwise, so that the step costs a plain one."""
    if not self.dynamic:
      heads = jax.lax.cond(jnp.any(fed), lambda: self.top_tokens(new.inputs, hidden, root), lambda: new.candidates)
      fresh = fed
    else:
      plans = jnp.any(self.planned_size(new, fed) > 1)
      probe = self.probing(new, step, fed) & ~plans
      branches = (lambda: new.candidates, lambda: self.probe_tokens(new, hidden, root),
                  lambda: self.top_tokens(new.inputs, hidden, root))
      heads = jax.lax.switch(jnp.where(plans, 2, probe.astype(jnp.int32)), branches)
      fresh = fed & (plans | probe)
      new = self.probe_schedule(new, step, fed & probe)
    return dataclasses.replace(new, candidates=jnp.where(fresh[:, None, None], heads, new.candidates),
                               have_candidates=jnp.where(fed, fresh, new.have_candidates))

  def probing(self, d: TreeState, step: jax.Array, fed: jax.Array) -> jax.Array:
    """Whether head 0 runs this step although no tree is planned: when a fed request's next probe is due. Its
    candidates then wait for a plain step, whose token is head 0's target (`count_hits`): without these probes a
    batch that once found trees not worth their cost would never observe its heads again, and so never find out
    that they started to hit (a list, a repeated phrase). The other heads would observe nothing on a plain step."""
    if self.probe_every <= 0:
      return jnp.zeros((), bool)
    return jnp.any(fed & (step >= d.next_probe))

  def probe_schedule(self, d: TreeState, step: jax.Array, probed: jax.Array) -> TreeState:
    """After a probe of the `probed` [B] requests: the next in `probe_gap` steps, and the gap after it doubled (up
    to `probe_max`); a hit of head 0 brings it back to `probe_every` (`count_hits`). Where no tree pays and the
    heads keep missing, probes thin out from one step in `probe_every` to one in `probe_max` (head 0's pass over
    the draft vocabulary's rows then costs next to nothing), and a run of hits still finds trees again in a few
    steps."""
    return dataclasses.replace(
        d, probes=d.probes + probed, next_probe=jnp.where(probed, step + d.probe_gap, d.next_probe),
        probe_gap=jnp.where(probed, jnp.minimum(2 * d.probe_gap, max(self.probe_max, self.probe_every)),
                            d.probe_gap))

  def top_tokens(self, inputs: dict, hidden, root) -> jax.Array:
    """[B, H, k] the heads' top tokens at a path node (hidden [B, D]; root [B]: the base model's choice there)."""
    return medusa.rule_top_tokens(inputs, hidden, root, self.top_k, self.softcap)

  def probe_tokens(self, d: TreeState, hidden, root) -> jax.Array:
    """[B, H, k] `d.candidates` with head 0's top tokens at a path node in place of its own (the others unchanged)."""
    first = {name: w if name == "vocab" else w[:1] for name, w in d.inputs["heads"].items()}  # head 0's weights
    return d.candidates.at[:, :1].set(self.top_tokens({**d.inputs, "heads": first}, hidden, root))

  # --- while no request plans a tree: plain decoding's step ------------------------------------------
  def cheaper_steps(self, cfg: InterpreterConfig) -> CheaperSteps | None:
    """ProPD: plain decoding's step (`PlainSteps`, on main's lane alone) while every request's next step is the
    root alone. Medusa feeds its whole tree every step: none."""
    if not self.dynamic:
      return None
    plain = dataclasses.replace(cfg, lanes=1, rules=PlainSteps(ignore_eos=self.ignore_eos, speculation=self))
    return CheaperSteps(plain, lambda view: ~jnp.any(self.next_sizes(view, cfg) > 1), self.main_lane, self.all_lanes)

  @staticmethod
  def main_lane(state: InterpState) -> InterpState:
    """The state plain decoding's step sees: main's lane alone, its pending token and position the next root."""
    d: TreeState = state.rule_state
    view = dataclasses.replace(state, **{f: getattr(state, f)[:, :1] for f in LANE_FIELDS})
    return dataclasses.replace(view, token=d.root_token[:, None], position=d.root_pos[:, None])

  @staticmethod
  def all_lanes(state: InterpState, view: InterpState) -> InterpState:
    """`view` (main's lane, after plain steps) put back into `state`'s lanes; every lane of a request that ended is
    done, as a tree step leaves them."""
    merged = dataclasses.replace(view, **{f: getattr(state, f).at[:, :1].set(getattr(view, f)) for f in LANE_FIELDS})
    return dataclasses.replace(merged, status=jnp.where(view.status[:, :1] == DONE, DONE, merged.status))

  def accepted_nodes(self, state, node_token, chosen, logits, row_ok, depth, parent, cfg) -> jax.Array:
    """[B, Q] bool: nodes whose whole path is accepted (the root always is)."""
    if self.acceptance == "greedy":
      match = node_token == chosen[:, parent]
    else:
      heat = state.sampling.temperature  # [B]: each row's; a greedy row's typical acceptance reads its plain logits
      temperature = jnp.where(heat > 0, jnp.maximum(heat, 1e-6), 1.0)[:, None, None]
      log_p = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [B, Q, V]
      entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)  # [B, Q]
      threshold = jnp.minimum(self.typical_epsilon, self.typical_delta * jnp.exp(-entropy))
      p_child = jnp.exp(jnp.take_along_axis(log_p[:, parent], node_token[..., None], axis=-1)[..., 0])
      match = p_child > threshold[:, parent]
    match &= row_ok & ~jnp.isin(node_token, jnp.asarray(cfg.vocab.eos_ids))
    if cfg.max_content:  # never write past the content budget (each path node is one more token)
      room = jnp.where(state.content_budget > 0, state.content_budget - state.content, jnp.iinfo(jnp.int32).max)
      match &= depth[None, :] < room[:, None]
    accepted = (jnp.arange(depth.shape[0]) == 0)[None, :] & row_ok
    for level in range(1, self.tree.max_depth + 1):
      accepted |= (depth == level)[None, :] & match & accepted[:, parent]
    return accepted

  def count_hits(self, new: TreeState, old: TreeState, node_token, on_path, depth, bonus, last_depth, fed):
    """Head h's target (the token at depth h + 1) is observed when the path reached depth h: it is the
    path's node there, or the bonus token just past the path's end. Counts its rank in head h's list."""
    heads = jnp.arange(self.num_heads)
    at_depth = (depth[None, None, :] == heads[None, :, None] + 1) & on_path[:, None, :]  # [B, H, Q]
    path_token = jnp.sum(jnp.where(at_depth, node_token[:, None, :], 0), axis=2)
    target = jnp.where(heads[None, :] < last_depth[:, None], path_token, bonus[:, None])
    seen = (heads[None, :] <= last_depth[:, None]) & (fed & old.have_candidates)[:, None]  # [B, H]
    hit = (old.candidates == target[:, :, None]) & seen[:, :, None]
    first_hit = jnp.any(hit[:, 0], axis=1)  # head 0 right: probe again at once, and then soon (`probe_schedule`)
    return dataclasses.replace(new, hits=new.hits + hit, trials=new.trials + seen,
                               probe_gap=jnp.where(first_hit, self.probe_every, new.probe_gap),
                               next_probe=jnp.where(first_hit, 0, new.next_probe))

  # --- after: records and the pool -----------------------------------------------------------------
  def after_model(self, state: InterpState, step: StepFeed, sampled, cfg: InterpreterConfig, length_table):
    at_end, out_of_room, slots = step.plan
    d: TreeState = state.rule_state
    path = d.path & step.feed
    fed = step.feed[:, 0]
    ended = at_end | jnp.any(path & jnp.isin(sampled, jnp.asarray(cfg.vocab.eos_ids)), axis=1)
    b = jnp.arange(slots.shape[0])[:, None]
    keep = jnp.where(path, slots, cfg.pool_slots)
    drop = jnp.where(step.feed & ~path, slots, cfg.pool_slots)
    state = dataclasses.replace(
        state,
        slot_owner=state.slot_owner.at[b, keep].set(0, mode="drop"),  # the accepted path joins main
        slot_valid=state.slot_valid.at[b, drop].set(False, mode="drop"),  # the rest of the tree is released
        token=jnp.where(path, sampled, state.token),  # each path lane records its next token
        position=jnp.where(path, state.position + 1, state.position),
        thread=jnp.where(path, 0, state.thread),
        status=jnp.where(ended[:, None], DONE, state.status),
        finished=state.finished | ended, truncated=state.truncated | out_of_room,
        pool_full=state.pool_full | out_of_room,
        last_fed_step=jnp.where(fed, state.step, state.last_fed_step))
    return state, path

  def max_records(self, cfg: InterpreterConfig) -> int:
    return cfg.pool_slots + cfg.lanes + 1

  def host_outputs(self, rule_state: Any, request: int) -> dict:
    d = rule_state
    steps = int(d.tree_steps[request])
    trials = np.asarray(d.trials[request])
    hits = np.asarray(d.hits[request])
    return {"tree_steps": steps, "tree_tokens": int(d.written[request]),
            "accept_length": float(d.written[request]) / max(steps, 1),
            "head_top1": [float(h) for h in hits[:, 0] / np.maximum(trials, 1)],
            "head_topk": [float(h) for h in hits.sum(axis=1) / np.maximum(trials, 1)],
            "head_trials": [int(t) for t in trials],
            "tree_sizes": dict(zip(self.sizes, (int(c) for c in np.asarray(d.size_counts[request])))),
            "plain_steps": int(d.plain_steps[request]), "probes": int(d.probes[request]),
            "prune_rate": int(d.pruned[request]) / max(int(d.tree_nodes[request]), 1)}


@dataclasses.dataclass(frozen=True)
class PlainSteps(SequentialRules):
  """ProPD's step while no request plans a tree (`MedusaRules.cheaper_steps`): plain decoding's, on main's lane alone
  (one row per request, its K/V written in place: no lane-count switch), in the lowest free pool slot (tree steps
  free slots), and of the tree's work only its counters and, in a conditional, the heads on a probe step or where a
  tree is planned for the next step (`MedusaRules.next_candidates`)."""

  name: ClassVar[str] = "propd-plain"
  speculation: MedusaRules = MedusaRules(dynamic=True)

  def before_model(self, state: InterpState, cfg: InterpreterConfig, length_table: jax.Array):
    running, at_end, usable = self.speculation.next_step(state, cfg)
    room = jnp.any(usable, axis=1)
    feed = (running & ~at_end & room)[:, None]
    slots = jnp.where(feed, jnp.argmax(usable, axis=1)[:, None], cfg.pool_slots).astype(jnp.int32)
    state = write_slots(state, feed, slots)
    batch = feed.shape[0]
    none = (jnp.zeros((batch, 0, 5), jnp.int32), jnp.zeros((batch, 0), bool))
    return state, StepFeed(feed, slots, *none, (at_end, running & ~at_end & ~room))

  def model_extras(self, state: InterpState, cfg: InterpreterConfig, num_q: int) -> dict:
    del state, cfg, num_q
    return {"return_hidden": True}  # read by the heads on probe steps only

  def select_tokens(self, state: InterpState, rows_lane, row_ok, logits, cfg: InterpreterConfig,
                    model_out: ModelOutput | None = None):
    """Plain decoding's choice; then the counts a size-1 tree step keeps, and the heads when they are due."""
    state, chosen, refused = super().select_tokens(state, rows_lane, row_ok, logits, cfg)
    d: TreeState = state.rule_state
    fed, token = row_ok[:, 0] & state.live, chosen[:, 0]
    steps = fed.astype(jnp.int32)
    new = dataclasses.replace(
        d, root_token=jnp.where(fed, token, d.root_token), root_pos=d.root_pos + steps,
        tree_steps=d.tree_steps + steps, written=d.written + steps, size_counts=d.size_counts.at[:, 0].add(steps),
        plain_steps=d.plain_steps + steps)
    root_only = jnp.zeros((1,), jnp.int32)
    new = self.speculation.count_hits(new, d, token[:, None], fed[:, None], root_only, token,
                                      jnp.zeros_like(steps), fed)
    new = self.speculation.next_candidates(new, model_out.head_input[:, 0], token, fed, state.step)
    return dataclasses.replace(state, rule_state=new), chosen, refused
