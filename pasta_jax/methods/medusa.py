"""Token-tree speculation on the model's Medusa heads (paper 004's drafter): Medusa's fixed tree, and ProPD's
dynamic tree size with early pruning (paper 004). Greedy acceptance is lossless: the answer is the sequential one."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from pasta_jax.decode import speculation
from pasta_jax.decode.loop import bucket
from pasta_jax.decode.rules import SequentialRules
from pasta_jax.errors import PastaError
from pasta_jax.methods.base import Capabilities, Layout, Method, Setup, option_help

HEADS = option_help("the Medusa heads folder (default: the ones shipped with the model)")
ACCEPTANCE = option_help("greedy (lossless) or typical", cli=False)
CHOICES = option_help("an explicit tree as Medusa's choices list (default: the heads' calibrated tree)", cli=False)
IGNORE_EOS = option_help("decode past the end id (fixed-length timing runs)", cli=False)
CALIBRATION_PROMPT = "Give three tips for staying healthy."  # ProPD's step times, when no prompt is at hand


def speculation_result(run, seconds, tokenizer, vocab, method, base):
  """`base`'s result with what the tree did: accepted lengths, per-head hit rates, tree sizes chosen."""
  return dataclasses.replace(base(run, seconds, tokenizer, vocab, method), speculation=run.rule_outputs)


@dataclasses.dataclass(frozen=True)
class Medusa(Method):
  name = "medusa"
  summary = "Medusa: token-tree speculation on the model's Medusa heads, a fixed tree (lossless greedy; streams)"
  capabilities = Capabilities(stream=True, shard=True)

  tree_size: int = dataclasses.field(default=speculation.FIXED_TREE, metadata=option_help("the tree's nodes"))
  heads: Any = dataclasses.field(default=None, metadata=HEADS)
  acceptance: str = dataclasses.field(default="greedy", metadata=ACCEPTANCE)
  choices: Any = dataclasses.field(default=None, metadata=CHOICES)
  prune: Any = dataclasses.field(default=None, metadata=option_help(
      "early pruning (`decode.rules.pruning.EarlyPrune`; None: the method's default; False: off)", cli=False))
  ignore_eos: bool = dataclasses.field(default=False, metadata=IGNORE_EOS)
  dynamic = False  # ProPD picks a prefix of the tree each step from its step-time table

  def check_options(self) -> None:
    if self.acceptance not in ("greedy", "typical"):
      raise ValueError(f"acceptance must be 'greedy' or 'typical', got {self.acceptance!r}")
    if self.tree_size is not None and self.tree_size < 1:
      raise ValueError(f"tree_size must be at least 1, got {self.tree_size}")

  def check_request(self, *, sampling, runtime, forced) -> None:
    super().check_request(sampling=sampling, runtime=runtime, forced=forced)
    if runtime.certify_head and self.acceptance != "greedy":
      raise PastaError("certify_head certifies greedy choices; typical acceptance reads probabilities from the logits")

  def setup(self, model, setup: Setup) -> Medusa:
    return dataclasses.replace(self, heads=speculation.load_drafter(model, self.heads))

  def layout(self, model, scripts) -> Layout:
    drafter = speculation.load_drafter(model, self.heads)
    rules, inputs = speculation.rules_and_inputs(
        drafter, tree_size=self.tree_size, dynamic=self.dynamic, acceptance=self.acceptance,
        latency=getattr(self, "latency", None), choices=self.choices,
        prune=speculation.early_prune(self.dynamic, self.prune, drafter))
    rules = dataclasses.replace(rules, ignore_eos=self.ignore_eos, softcap=model.config.final_logit_softcap)
    return Layout(rules, rules.tree.size, rules.tree.size, inputs)

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return speculation_result(run, seconds, tokenizer, vocab, method, super().build_result)


@dataclasses.dataclass(frozen=True)
class Propd(Medusa):
  name = "propd"
  summary = "ProPD: Medusa with a dynamic tree size from measured step times, and early pruning (streams)"
  capabilities = Capabilities(shard=True, learns_latency=True)  # served, its text is handed out at the end
  dynamic = True

  tree_size: int | None = dataclasses.field(default=None, metadata=option_help(
      f"the largest tree (default {speculation.DEFAULT_TREE}; served: {speculation.SERVED_PROPD_TREE})"))
  latency: Any = dataclasses.field(default=None, metadata=option_help(
      "the step-time model: (alpha, beta) seconds or {size: seconds} (default: measured here, "
      "`decode.latency.calibrate_latency`)", cli=False))

  def setup(self, model, setup: Setup) -> Propd:
    """Its heads, and (unless given) its step times measured on this device at the run's batch size and pool: the
    table ProPD picks from and the tree it compiles (1 node, plain decoding, when no tree can pay here)."""
    from pasta_jax.decode.latency import calibrate_latency
    drafter = speculation.load_drafter(model, self.heads)
    size = self.tree_size or speculation.DEFAULT_TREE
    if self.latency is not None:
      return dataclasses.replace(self, heads=drafter, tree_size=size)
    ids = setup.ids or [model.tokenizer.encode(model.tokenizer.format_chat(CALIBRATION_PROMPT), add_bos=True)]
    print(f"[propd: timing each tree size on this device at batch {len(ids)} (once per model and batch)...]",
          file=sys.stderr)
    cal = calibrate_latency(model, ids, drafter, tree_size=size, steps=16, run_tokens=setup.max_new_tokens,
                            prune=self.prune, runtime=setup.runtime)
    if not cal["tree_pays"]:
      print(f"[propd: no tree of {cal['timed_tree']} nodes can beat a plain step here (T(1) "
            f"{1e3 * cal['table'][1]:.1f} ms, T(2) {1e3 * cal['table'][2]:.1f} ms; speculation.tree_pays): "
            "decoding plainly]", file=sys.stderr)
    return dataclasses.replace(self, heads=drafter, tree_size=cal["tree_size"], latency=cal["table"])

  def setup_key(self, setup: Setup) -> tuple:
    """Step times depend on the batch, the prompt bucket and the pool the run will have, and on the runtime."""
    longest = max((len(p) for p in setup.ids), default=0)
    return (len(setup.ids), bucket(longest), setup.max_new_tokens, setup.runtime)

  def serving(self, model, setup: Setup) -> Propd:
    """Served, the step times are learned from the batch's own chunks (`serve/propd.py`): a placeholder table."""
    return dataclasses.replace(self, heads=speculation.load_drafter(model, self.heads), latency=(1.0, 1.0),
                               tree_size=self.tree_size or speculation.SERVED_PROPD_TREE)

  def layout(self, model, scripts) -> Layout:
    if self.tree_size == 1:  # the root alone every step: plain decoding (`speculation.tree_pays`)
      return Layout(SequentialRules(ignore_eos=self.ignore_eos), 1, 1)
    if self.latency is None:
      raise PastaError("method='propd' needs a latency model: latency=(alpha, beta) seconds, or per-size times "
                       "(`setup` measures them)")
    return super().layout(model, scripts)
