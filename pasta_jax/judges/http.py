"""The OpenAI-compatible HTTP judge: confidence from the first token's logprobs where given."""

from __future__ import annotations

import math

from pasta_jax.endpoint import ChatClient, EndpointConfig
from pasta_jax.judges import prompt
from pasta_jax.judges.base import Verdict


def p_first_from_logprobs(top: dict[str, float]) -> float | None:
  """P(A) from the first token's top logprobs: softmax over the A and B mass (None if neither is there)."""
  mass = {"A": 0.0, "B": 0.0}
  for token, logprob in top.items():
    letter = prompt.letter_of(token)
    if letter is not None:
      mass[letter] += math.exp(logprob)
  total = mass["A"] + mass["B"]
  return mass["A"] / total if total > 0 else None


class HttpJudge:
  """Judge over any OpenAI-compatible endpoint (config from PASTA_JUDGE_* by default)."""

  def __init__(self, config: EndpointConfig, client: ChatClient | None = None, top_logprobs: int = 5):
    self.client = client or ChatClient(config)
    self.top_logprobs = top_logprobs
    self.name = f"http:{config.model}:{prompt.PROMPT_VERSION}"

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    reply = self.client.complete(prompt.messages(instruction, first, second), max_tokens=4,
                                 logprobs=self.top_logprobs)
    if reply.top_logprobs:
      p = p_first_from_logprobs(reply.top_logprobs)
      if p is not None:
        return Verdict(p, reply.text)
    choice = prompt.parse_choice(reply.text)  # no logprobs: the letter alone, full confidence
    p = {"A": 1.0, "B": 0.0}.get(choice, 0.5)
    return Verdict(p, f"{reply.text} [no logprobs{'' if choice else '; unparseable: tie'}]")
