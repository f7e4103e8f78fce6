"""A decoding method declared the way a new one is added: one file, and its line in the registry (`register`).

Steady decoding is plain decoding that may write past the end id, so that every answer is exactly its budget
long (fixed-length timing runs). It reuses the sequential rule object; its one option is a flag of the CLI.
"""

from __future__ import annotations

import dataclasses

from pasta_jax.decode.rules import SequentialRules
from pasta_jax.methods.base import Capabilities, Layout, Method, option_help


@dataclasses.dataclass(frozen=True)
class Steady(Method):
  name = "steady"
  summary = "plain decoding that writes past the end id: every answer is its budget long (streams)"
  capabilities = Capabilities(stream=True)

  past_end: bool = dataclasses.field(default=True, metadata=option_help("keep decoding past the end id"))

  def layout(self, model, scripts) -> Layout:
    return Layout(SequentialRules(ignore_eos=self.past_end), lanes=1, max_threads=1)
