"""PASTA x trees: the model's forks run as threads, and every live thread speculates with its own Medusa tree in the
same step. Greedy and lossless: the answer is PASTA's."""

from __future__ import annotations

import dataclasses
from typing import Any

from pasta_jax.decode import speculation
from pasta_jax.methods.base import Capabilities, Layout, Setup, Threaded, option_help
from pasta_jax.methods.medusa import CHOICES, HEADS, speculation_result


@dataclasses.dataclass(frozen=True)
class PastaTrees(Threaded):
  name = "pasta+medusa"
  summary = "PASTA x trees: PASTA's threads, every live one speculating with its own Medusa tree (thread chart)"
  capabilities = Capabilities(stream=True, shard=True, promises=True, threads=True)

  tree_size: int = dataclasses.field(default=speculation.THREAD_TREE, metadata=option_help("each thread's tree"))
  heads: Any = dataclasses.field(default=None, metadata=HEADS)
  choices: Any = dataclasses.field(default=None, metadata=CHOICES)

  def setup(self, model, setup: Setup) -> PastaTrees:
    return dataclasses.replace(self, heads=speculation.load_drafter(model, self.heads))

  def layout(self, model, scripts) -> Layout:
    rules, inputs = speculation.pasta_tree_rules(
        speculation.load_drafter(model, self.heads), tree_size=self.tree_size, thread_lanes=self.lanes,
        threads=self.max_threads, choices=self.choices, softcap=model.config.final_logit_softcap)
    return Layout(rules, rules.thread_lanes * rules.tree.size, self.max_threads + rules.node_lanes, inputs)

  def build_result(self, run, seconds, tokenizer, vocab, method):
    return speculation_result(run, seconds, tokenizer, vocab, method, super().build_result)
