"""Parallel against sequential on any device, with no weights file: a Gemma-3-270M-shaped model with
random weights force-replays synthetic answers (forced replay makes the timing independent of the
weights). For k = 1, 2, 4, 8 blocks of equal length, the same content is replayed three ways through
the one interpreter (greedy, batch 1, second of two runs): sequential (one lane), PASTA (k promises
then a sync) and APAR (k forks). Prints realized speedup against theoretical speedup per k.

  python -m bench.synthetic [--config gemma3-270m] [--tokens 256] [--lanes 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.common import second_of_two
from pasta_jax.decode.runtime import Runtime
from pasta_jax.lang.tags import TagVocab, round_length
from pasta_jax.methods import Apar, Pasta, generate_ids
from pasta_jax.model.config import get_config
from pasta_jax.model.gemma import Gemma
from pasta_jax.model.load import LoadedModel

TEXT = "abcdefghijklmnopqrstuvwxyz"


class SyntheticTokenizer:
  """One id per character above the tags; tags on ids 10..; enough for forced replays."""

  hf = None
  eos_ids = (1,)
  base = 300

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    return ([2] if add_bos else []) + [self.base + ord(c) for c in text]

  def decode(self, ids) -> str:
    return "".join(chr(i - self.base) for i in ids if self.base <= i < self.base + 0x10000)

  def tag_vocab(self) -> TagVocab:
    return TagVocab.from_base(10, self.eos_ids)


def random_model(name: str, dtype=jnp.float32):
  """A LoadedModel of preset `name` in its real shapes with random weights in `dtype` (each tensor drawn and cast
  inside one program, so a 7B model never holds a float32 copy), and bench.synthetic's tokenizer."""
  config = get_config(name)
  dummy = jnp.zeros((1, 4), jnp.int32)

  def init(key):
    params = Gemma(config).init(key, dummy, dummy, jnp.ones((1, 4, 4), bool))
    return jax.tree.map(lambda x: x.astype(dtype), params)

  return LoadedModel(config, jax.jit(init)(jax.random.key(0)), SyntheticTokenizer(), f"random:{name}")


def answers(tokens: int, blocks: int) -> tuple[str, str, str]:
  """(plain, PASTA, APAR) answers with the same content: an intro, then `blocks` equal parts."""
  intro = "intro: "
  size = (tokens - len(intro)) // blocks
  parts = ["".join(TEXT[(i + j) % 26] for j in range(size)) for i in range(blocks)]
  plain = intro + "".join(parts)
  if blocks == 1:
    return plain, plain, plain
  pasta = intro + "".join(f'<promise topic="p" tokens="{round_length(size)}"/><async>{p}</async>' for p in parts)
  apar = intro + "".join(f"<fork/><child>{p}</child>" for p in parts)
  return plain, pasta + "<sync/>", apar


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.synthetic", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="gemma3-270m")
  parser.add_argument("--tokens", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--dtype", default="float32")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  model = random_model(args.config)
  prompt = [model.tokenizer.encode("question: " + TEXT)]
  kw = dict(max_new_tokens=args.tokens + 64, runtime=Runtime(dtype=dtype))
  method = Pasta(lanes=args.lanes)
  print(f"device: {jax.devices()[0].device_kind}; {args.config} random weights, {args.dtype}, "
        f"{args.tokens}-token answers, {args.lanes} lanes")
  print(f"{'blocks':>6} {'t_seq':>8} {'t_pasta':>8} {'pasta':>7} {'theory':>7} {'t_apar':>8} {'apar':>7} "
        f"{'theory':>7} {'ms/step seq':>12}")
  ratios = []
  for blocks in (1, 2, 4, 8):
    plain, pasta, apar = answers(args.tokens, blocks)
    seq = second_of_two(lambda plain=plain: generate_ids(model, prompt, method, forced_answers=[plain], **kw)[0])
    par = second_of_two(lambda pasta=pasta: generate_ids(model, prompt, method, forced_answers=[pasta], **kw)[0])
    apar_method = Apar(lanes=max(args.lanes, blocks + 1))
    tree = second_of_two(lambda apar=apar, apar_method=apar_method: generate_ids(
        model, prompt, apar_method, forced_answers=[apar], **kw)[0])
    assert seq.text == par.text == tree.text, "the three replays must write the same text"
    r_pasta, r_apar = seq.seconds / par.seconds, seq.seconds / tree.seconds
    ratios.append((blocks, r_pasta / par.theoretical_speedup, r_apar / tree.theoretical_speedup))
    print(f"{blocks:>6} {seq.seconds:>8.3f} {par.seconds:>8.3f} {r_pasta:>7.2f} "
          f"{par.theoretical_speedup:>7.2f} {tree.seconds:>8.3f} {r_apar:>7.2f} {tree.theoretical_speedup:>7.2f} "
          f"{1e3 * seq.seconds / seq.steps:>12.2f}")
  pasta_eff = min(r for b, r, _ in ratios if b > 1)
  apar_eff = min(r for b, _, r in ratios if b > 1)
  print(f"RESULT min_pasta_realized_over_theoretical={pasta_eff:.3f} min_apar_realized_over_theoretical={apar_eff:.3f}")


if __name__ == "__main__":
  main()
