"""Where the log p gap of a `bench.learned` run sits: per answer (forked or not; the baseline finished or cut) and
per token (main's text, the blocks, the blocks' first tokens), under the run's baseline or --scorer.

  python -m bench.learned --limit 50 --out runs/learned50      # the run (decodes, measures, scores)
  python -m bench.logp_gap --run runs/learned50 [--out runs/learned50/logp_gap.md]

Reads the run's results.json (nothing is decoded again) and scores every answer once more, token by token. The
RESULT line is the first PASTA model's: the gap of its forked and not-forked answers, and the mean log p per token
of main's text, the blocks and the blocks' first tokens in its answers that fork.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pasta_jax.eval import methods as M
from pasta_jax.eval.logp_gap import answer_split, split_lines, token_split
from pasta_jax.eval.quality import answer_token_logprobs


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.logp_gap", description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", default="runs/learned", help="a bench.learned run folder (its --out)")
  parser.add_argument("--scorer", help="the scoring model (default: the run's baseline)")
  parser.add_argument("--out", help="markdown report (default: RUN/logp_gap.md)")
  return parser.parse_args(argv)


def read_results(run: Path) -> dict:
  path = run / "results.json"
  if not path.is_file():
    raise SystemExit(f"bench.logp_gap: {path}: no results here; run `python -m bench.learned --out {run}` first")
  return json.loads(path.read_text())


def main(argv=None) -> int:
  args = parse_args(argv)
  run = Path(args.run)
  results = read_results(run)
  settings = results["settings"]
  scorer_path = args.scorer or json.loads((run / "run.json").read_text())["baseline"]
  scorer = M.cached_model(scorer_path)
  bar = tqdm(desc=f"log p under {scorer_path}", unit="answer")

  @functools.cache
  def token_logp(prompt: str, text: str) -> tuple[np.ndarray, np.ndarray]:
    bar.update(1)
    return answer_token_logprobs(scorer, prompt, text)

  def logp(prompt: str, text: str) -> float:  # answer_logprob's mean, from the same one forward
    return float(np.mean(token_logp(prompt, text)[0]))

  lines = [f"# Where the log p gap sits: {run}, {len(results['prompts'])} prompts, under {scorer_path}", ""]
  first = None
  for method in settings["methods"]:
    answers = answer_split(results, method, settings["baseline"], logp)
    tokens = token_split(results, method, token_logp)
    lines += split_lines(method, answers, tokens)
    first = first or (answers, tokens)
  bar.close()
  out = Path(args.out) if args.out else run / "logp_gap.md"
  out.write_text("\n".join(lines))
  print("\n".join(lines))
  answers, tokens = first
  print(f"wrote {out}")
  print(f"RESULT gap_forked={answers['forked']['gap']:.3f} gap_not_forked={answers['not forked']['gap']:.3f} "
        f"main={tokens['main']['logprob']:.3f} block={tokens['block']['logprob']:.3f} "
        f"block_start={tokens['block start']['logprob']:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
