"""Attention over the thread metadata: XLA (the dense mask) against the Pallas kernel, by pool size and by the
share of the pool a query can see, on whatever device runs it.

A decode-shaped call: 8 query rows (lanes) of one request over a pool of S slots written by 8 threads, with
Gemma 3 270M's head layout (4 query heads, 1 KV head, head_dim 256) unless flags say otherwise. "Visible" is
the share of the pool each query row sees (main's prefix; the rest belongs to forks it does not see), so
the kernel can skip the other tiles. The kernel is the device's own ("pallas": Mosaic on a TPU, Triton on a
GPU); on a CPU it runs in interpret mode, so there only correctness counts and no speedup is reported.

  python -m bench.attention [--slots 512,1024,...,32768] [--visible 0.1,0.5,1.0] [--heads 4,1] [--head-dim 256]
                            [--block-k 64] [--splits N]
Last line: RESULT max_abs_diff=... speedup_4k=... speedup_32k=... (speedups at 10% visible; nan on a CPU)
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import device_time, table
from pasta_jax.model.thread_attention import AttentionSpec, attention, resolve
from pasta_jax.visibility import HIDDEN, UNBOUNDED, ThreadMask

THREADS = 8
CHECK_UP_TO = 4096  # pools checked against XLA in interpret mode (a CPU); every size on an accelerator


def decode_call(slots: int, visible: float, heads: int, kv_heads: int, head_dim: int, lanes: int, seed: int = 0):
  """(q, k, v, mask, q_pos, kv_pos): main owns the first `visible` share of the pool, forks the rest; each
  query row sees main's prefix and its own fork only up to its first slot (so about `visible` of the pool)."""
  rng = np.random.default_rng(seed)
  main = max(1, int(slots * visible))
  owner = np.where(np.arange(slots) < main, 0, 1 + np.arange(slots) % (THREADS - 1))[None]
  horizon = np.full((1, lanes, THREADS), HIDDEN)
  horizon[0, :, 0] = UNBOUNDED
  mask = ThreadMask(jnp.asarray(horizon, jnp.int32), jnp.asarray(owner, jnp.int32),
                    jnp.arange(slots, dtype=jnp.int32)[None], jnp.ones((1, slots), bool))
  q = jnp.asarray(rng.normal(size=(1, lanes, heads, head_dim)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(1, slots, kv_heads, head_dim)), jnp.bfloat16) for _ in range(2))
  positions = jnp.arange(slots, dtype=jnp.int32)[None]
  return q, k, v, mask, jnp.full((1, lanes), slots, jnp.int32), positions


def plot(rows: list[dict], path: str, title: str) -> None:
  """Attention time against pool size, XLA dashed and the kernel solid, one colour per visible share."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for n, share in enumerate(sorted({r["visible"] for r in rows})):
    mine = sorted((r for r in rows if r["visible"] == share), key=lambda r: r["slots"])
    slots = [r["slots"] for r in mine]
    ax.plot(slots, [1e3 * r["xla_ms"] for r in mine], "--o", color=f"C{n}", label=f"XLA, {share:.0%} visible")
    ax.plot(slots, [1e3 * r["kernel_ms"] for r in mine], "-s", color=f"C{n}", label=f"kernel, {share:.0%} visible")
  ax.set(xscale="log", xlabel="pool slots", ylabel="microseconds per call", title=title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench.attention", description=__doc__.split("\n\n")[0])
  parser.add_argument("--slots", default="512,1024,2048,4096,8192,16384,32768")
  parser.add_argument("--visible", default="0.1,0.5,1.0")
  parser.add_argument("--heads", default="4,1", help="query heads, KV heads (Gemma 3 270M: 4,1; Gemma 7B: 16,16)")
  parser.add_argument("--head-dim", type=int, default=256)
  parser.add_argument("--lanes", type=int, default=8)
  parser.add_argument("--runs", type=int, default=5, help="timed programs (each chains 50 calls)")
  parser.add_argument("--kernel", default="pallas", help="pallas (the device's), pallas-tpu or pallas-gpu")
  parser.add_argument("--block-k", type=int, default=None, help="keys per tile (default: 512 TPU, 64 GPU)")
  parser.add_argument("--splits", type=int, default=None, help="GPU kernel: pool ranges (default: fill the GPU)")
  parser.add_argument("--plot", default=None, help="also draw time against pool size into this PNG")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  heads, kv_heads = (int(x) for x in args.heads.split(","))
  implementation, interpret = resolve(args.kernel)
  xla_spec = AttentionSpec(scale=args.head_dim**-0.5)
  block_k = args.block_k or (64 if implementation == "pallas-gpu" else 512)
  kernel_spec = AttentionSpec(scale=args.head_dim**-0.5, implementation=implementation, interpret=interpret,
                              block_q=args.lanes, block_k=block_k, splits=args.splits)
  xla_call = lambda *a: attention(*a, xla_spec)  # noqa: E731
  kernel_call = lambda *a: attention(*a, kernel_spec)  # noqa: E731
  xla, kernel = jax.jit(xla_call), jax.jit(kernel_call)
  rows, worst = [], 0.0
  for slots in (int(s) for s in args.slots.split(",")):
    for share in (float(x) for x in args.visible.split(",")):
      call = decode_call(slots, share, heads, kv_heads, args.head_dim, args.lanes)
      t_xla = device_time(xla_call, call, args.runs)
      row = dict(device=jax.default_backend(), slots=slots, visible=share, xla_ms=1e3 * t_xla, kernel_ms=math.nan,
                 speedup=math.nan, max_abs_diff=math.nan)
      if not interpret or slots <= CHECK_UP_TO:
        diff = jnp.abs(kernel(*call).astype(jnp.float32) - xla(*call).astype(jnp.float32)).max()
        row["max_abs_diff"] = float(diff)
        worst = max(worst, row["max_abs_diff"])
      if not interpret:
        t_kernel = device_time(kernel_call, call, args.runs)
        row.update(kernel_ms=1e3 * t_kernel, speedup=t_xla / t_kernel)
      rows.append(row)
  print(f"{jax.devices()[0].device_kind}: {heads} query heads, {kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.lanes} lanes, bfloat16; {implementation} with {block_k}-key tiles; device time per call: 50 calls "
        f"chained in one program, median of {args.runs} programs")
  print(table(rows, ("device", "slots", "visible", "xla_ms", "kernel_ms", "speedup", "max_abs_diff")))
  if interpret:
    print(f"{implementation} ran in interpret mode on {jax.default_backend()}: only correctness counts here")
  if args.plot and not interpret:
    plot(rows, args.plot, f"{jax.devices()[0].device_kind}: {heads} query / {kv_heads} KV heads, hd {args.head_dim}")
  at = {(r["slots"], r["visible"]): r["speedup"] for r in rows}
  low = min(float(x) for x in args.visible.split(","))
  print(f"RESULT max_abs_diff={worst:.2e} speedup_4k={at.get((4096, low), math.nan):.2f} "
        f"speedup_32k={at.get((32768, low), math.nan):.2f}")


if __name__ == "__main__":
  main()
