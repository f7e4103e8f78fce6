"""Greedy decode of 128 new tokens on the real Gemma 3 270M: pasta_jax against transformers.

Both load the same GGUF, decode the same prompt (by default on the CPU), and are timed as the median of 5 runs
after a warm-up. Prints tokens/s, their ratio and the fraction of the memory-bandwidth roofline
(weight bytes read per token / measured copy bandwidth).

  python -m bench.decode [--new-tokens 128] [--runs 5] [--dtype float32] [--model x.gguf --hf-device cuda]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import copy_bandwidth, median_time
from pasta_jax.decode.runtime import Runtime
from pasta_jax.methods import Sequential, generate_ids
from pasta_jax.model.load import embedded_gguf_path, load_model

PROMPT = "Explain why the sky is blue, in a few short paragraphs."


def ours(model, prompt_ids, new_tokens, runs, dtype):
  """Plain greedy decoding through the one interpreter (`Sequential(ignore_eos=True)`: end ids never sampled, as
  transformers' min_new_tokens): tokens/s of the device run (prefill included) and the tokens. The prefill
  samples the first token, each of the `new_tokens - 1` steps one more (max_new_tokens is a content budget)."""
  def run():
    [result] = generate_ids(model, [prompt_ids], Sequential(ignore_eos=True), max_new_tokens=new_tokens,
                            runtime=Runtime(dtype=dtype))
    return result

  run()  # compiles
  results = [run() for _ in range(runs)]
  seconds = sorted(r.seconds for r in results)[runs // 2]
  return new_tokens / seconds, results[0].records[:, 3].tolist()


def hf(gguf_path, prompt_ids, new_tokens, runs, device):
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 1)
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                               dtype=torch.float32).eval().to(device)
  inputs = torch.tensor([prompt_ids], device=device)

  def run():
    with torch.inference_mode():
      return model.generate(inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

  seconds, _ = median_time(run, runs)
  return new_tokens / seconds, run()[0, len(prompt_ids):].tolist()


def weight_bytes_per_token(params, dtype) -> int:
  """Every parameter is read once per decoded token (the tied embedding as the output head)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) * jnp.dtype(dtype).itemsize


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.decode", description=__doc__.split("\n\n")[0])
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--model", default=None, help="GGUF path (default: the embedded Gemma 3 270M)")
  parser.add_argument("--hf-device", default="cpu", help="torch device of the transformers run (cuda on a GPU)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  gguf_path = str(args.model or embedded_gguf_path())
  model = load_model(gguf_path)
  prompt_ids = model.tokenizer.encode(model.tokenizer.format_chat(PROMPT), add_bos=True)
  dtype = jnp.dtype(args.dtype)
  ours_tps, our_tokens = ours(model, prompt_ids, args.new_tokens, args.runs, dtype)
  print(f"ours: {ours_tps:.2f} tok/s")
  hf_tps, hf_tokens = hf(gguf_path, prompt_ids, args.new_tokens, args.runs, args.hf_device)
  print(f"transformers: {hf_tps:.2f} tok/s")
  agree = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), len(our_tokens))
  print(f"greedy tokens identical for the first {agree} of {args.new_tokens}")
  bandwidth = copy_bandwidth()
  per_token = weight_bytes_per_token(model.params, dtype)
  roofline = bandwidth / per_token
  print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, weights {per_token / 1e6:.0f} MB/token, "
        f"roofline {roofline:.1f} tok/s, ours at {ours_tps / roofline:.0%} of it")
  print(f"RESULT ours_tok_s={ours_tps:.2f} hf_tok_s={hf_tps:.2f} ratio={ours_tps / hf_tps:.2f} "
        f"roofline_fraction={ours_tps / roofline:.2f}")


if __name__ == "__main__":
  main()
