"""Where the log p gap of a PASTA model's answers sits, under a scoring model (Baseline-SFT in `bench.learned`).

Two splits of a `bench.learned` run's results:
  per answer  the answers that fork against those that do not, each beside the baseline's answer to the same
              prompt; and the prompts where the baseline finished against those it ran to the token budget
              (a greedy answer cut mid-loop is a likely one: such cuts raise the baseline's side)
  per token   in the answers that fork: main's text, the blocks' text, and each block's first tokens, the seam
              where a block starts without having read its earlier siblings

If most of the gap sits in main's text as much as in the blocks, the model writes other text than the scorer's
mode, and decoding the blocks apart is not what costs the likelihood.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from pasta_jax.lang import metrics

BLOCK_START_TOKENS = 3
PLACES = ("main", "block", "block start")
ANSWER_GROUPS = ("forked", "not forked", "baseline finished", "baseline cut")

LogpFn = Callable[[str, str], float]  # (prompt, clean answer) -> mean log p per token
TokenLogpFn = Callable[[str, str], tuple[np.ndarray, np.ndarray]]  # -> ([N] log p, [N] start characters)


def token_places(starts: Sequence[int], spans: Sequence[tuple[int, int]],
                 first: int = BLOCK_START_TOKENS) -> list[str]:
  """The place of each token, from the character where it starts: "block start" for a block's first `first`
  tokens, "block" for its others, "main" for every token outside the blocks' spans (the end token too)."""
  places, seen = [], {}
  for start in starts:
    block = next((i for i, (lo, hi) in enumerate(spans) if lo <= start < hi), None)
    if block is None:
      places.append("main")
      continue
    seen[block] = seen.get(block, 0) + 1
    places.append("block start" if seen[block] <= first else "block")
  return places


def _summary(pairs: Sequence[tuple[float, float]]) -> dict:
  if not pairs:
    return dict(n=0, pasta=float("nan"), baseline=float("nan"), gap=float("nan"))
  pasta, baseline = (float(np.mean(side)) for side in zip(*pairs))
  return dict(n=len(pairs), pasta=pasta, baseline=baseline, gap=(pasta - baseline) / abs(baseline))


def answer_split(results: Mapping, method: str, baseline: str, logp: LogpFn) -> dict[str, dict]:
  """Per group of prompts: n, the mean log p of `method`'s answers and of the baseline's, and the gap relative
  to the baseline's (-0.3: 30% below)."""
  groups: dict[str, list[tuple[float, float]]] = {name: [] for name in ANSWER_GROUPS}
  for prompt in results["prompts"]:
    run, base = prompt["runs"][method], prompt["runs"][baseline]
    pair = (logp(prompt["instruction"], run["text"]), logp(prompt["instruction"], base["text"]))
    groups["forked" if run["threads"] > 1 else "not forked"].append(pair)
    groups["baseline finished" if base["finished"] else "baseline cut"].append(pair)
  return {name: _summary(pairs) for name, pairs in groups.items()}


def token_split(results: Mapping, method: str, token_logp: TokenLogpFn) -> dict:
  """Over `method`'s answers that fork: tokens and mean log p per place ("block" counts the block starts too);
  `unplaced`: forked answers whose tags do not parse strictly (a block left open at the budget), not counted."""
  logps: dict[str, list[float]] = {place: [] for place in PLACES}
  unplaced = 0
  for prompt in results["prompts"]:
    run = prompt["runs"][method]
    if run["threads"] < 2:
      continue
    parsed = metrics.block_spans(run["annotated"])
    if parsed is None or parsed[0] != run["text"]:
      unplaced += 1
      continue
    values, starts = token_logp(prompt["instruction"], run["text"])
    for value, place in zip(values.tolist(), token_places(starts.tolist(), parsed[1])):
      logps[place].append(value)
      if place == "block start":
        logps["block"].append(value)
  out = {place: dict(tokens=len(v), logprob=float(np.mean(v)) if v else float("nan")) for place, v in logps.items()}
  return {**out, "unplaced": unplaced}


def split_lines(method: str, answers: Mapping[str, dict], tokens: Mapping) -> list[str]:
  """Markdown tables of both splits for one method."""
  lines = [f"## {method}", "", "| prompts | n | log p, PASTA | log p, baseline | gap |", "|---|---|---|---|---|"]
  for name, row in answers.items():
    lines.append(f"| {name} | {row['n']} | {row['pasta']:.3f} | {row['baseline']:.3f} | {row['gap'] * 100:+.1f}% |")
  lines += ["", f"| tokens of the answers that fork ({tokens['unplaced']} not placed: tags that do not parse) "
            "| tokens | log p |", "|---|---|---|"]
  lines += [f"| {place} | {tokens[place]['tokens']} | {tokens[place]['logprob']:.3f} |" for place in PLACES]
  return lines + [""]
