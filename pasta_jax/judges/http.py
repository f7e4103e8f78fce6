"""The OpenAI-compatible HTTP judge: confidence from the verdict token's logprobs where given.

A hard letter says nothing about how sure the judge was, and win rates averaged over soft verdicts
are far less noisy, so the judge asks for top logprobs and reads P(A) / (P(A) + P(B)) off the token
that carries the letter (the first one, or the first after a leading "[[" or "**"). Endpoints that
give no logprobs, or refuse the parameter, still work: the parsed letter counts as certain.
"""

from __future__ import annotations

import logging
import math

from pasta_jax.endpoint import ChatClient, Completion, EndpointConfig, EndpointError
from pasta_jax.judges import prompt
from pasta_jax.judges.base import Verdict

log = logging.getLogger(__name__)
TOP_LOGPROBS = 5  # alternatives per token: enough to hold both letters whenever the judge hesitates


def p_first_from_logprobs(top: dict[str, float]) -> float | None:
  """P(A) from one token's top logprobs: softmax over the A and B mass (None if neither is there).

  Tokens that spell the same letter (' A', 'A', '[[A') add up, so tokenizers' variants all count.
  """
  letters = [(letter, logprob) for token, logprob in top.items() if (letter := prompt.letter_of(token)) is not None]
  peak = max((logprob for _, logprob in letters), default=-math.inf)
  if not math.isfinite(peak):
    return None  # no letter, or only letters of probability zero (NaN/+inf never get here: the client refuses them)
  mass = {"A": 0.0, "B": 0.0}
  for letter, logprob in letters:
    mass[letter] += math.exp(logprob - peak)  # relative to the largest: no overflow, whatever the server sent
  return mass["A"] / (mass["A"] + mass["B"])


def verdict_logprobs(reply: Completion) -> dict[str, float] | None:
  """The alternatives of the token that carries the letter: the first whose own text is a letter,
  within the first few tokens (a reply may open with '[[' or '**'); else the first token's."""
  for token, top in (reply.token_logprobs or ())[:4]:
    if prompt.letter_of(token) is not None:
      return top
  return reply.top_logprobs


class HttpJudge:
  """Judge over any OpenAI-compatible endpoint (config from PASTA_JUDGE_* by default)."""

  def __init__(self, config: EndpointConfig, client: ChatClient | None = None, top_logprobs: int = TOP_LOGPROBS):
    self.client = client or ChatClient(config)
    self.top_logprobs: int | None = top_logprobs
    self.name = f"http:{config.model}:{prompt.PROMPT_VERSION}"

  def __repr__(self) -> str:
    return f"HttpJudge({self.name!r})"

  def compare(self, instruction: str, first: str, second: str) -> Verdict:
    reply = self._ask(prompt.messages(instruction, first, second))
    top = verdict_logprobs(reply)
    p = p_first_from_logprobs(top) if top else None
    if p is not None:
      return Verdict(p, reply.text)
    choice = prompt.parse_choice(reply.text)  # the letter alone, full confidence
    why = "no logprobs" if not top else "no A/B among the logprobs"
    return Verdict({"A": 1.0, "B": 0.0}.get(choice, 0.5),
                   f"{reply.text} [{why}{'' if choice else '; unparseable: tie'}]")

  def _ask(self, messages: list[dict]) -> Completion:
    """Asks with logprobs; an endpoint that refuses them (400 naming logprobs) is asked without, from then on."""
    try:
      return self.client.complete(messages, max_tokens=8, temperature=0.0, logprobs=self.top_logprobs)
    except EndpointError as err:
      if self.top_logprobs is None or err.status != 400 or "logprob" not in str(err).lower():
        raise
    log.warning("%s refuses logprobs: judging from the reply's letter alone (hard verdicts)", self.name)
    self.top_logprobs = None
    return self.client.complete(messages, max_tokens=8, temperature=0.0)
