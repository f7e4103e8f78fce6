"""XLA flags the decoder wants on a GPU, set before the first computation starts a backend.

The decode loop is one `lax.while_loop` whose body holds conditionals (lane buckets, the certified head's
fallback, distinct topics). By default XLA:GPU records the body's kernels into CUDA graphs but runs the loop
and each conditional from the host: every iteration and every branch copies its predicate to the host and
waits for it, so the GPU idles while the host launches the next kernels. With WHILE and CONDITIONAL commands
the whole loop runs as one graph on the device. Measured on an H100 (`bench/gpu/overhead.sh`, 270M bfloat16):
the interpreter's one-lane step fell from 1.326x to 1.120x of plain decoding's; plain decoding unchanged, 8 live
lanes 2.4% slower (`docs/results/bench_seq_cost_h100_command_buffers.txt`).

The flags only read on a GPU (XLA parses, and the CPU backend ignores, every `xla_gpu_` flag). A user's own
`xla_gpu_enable_command_buffer` wins, and `PASTA_XLA_DEFAULTS=0` keeps XLA's defaults.
"""

from __future__ import annotations

import os

GPU_DECODE_FLAGS = ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", "--xla_gpu_graph_min_graph_size=1")
OPT_OUT = "PASTA_XLA_DEFAULTS"


def with_decode_flags(xla_flags: str, environ_opt_out: str | None = None) -> str:
  """XLA_FLAGS with the decoder's GPU flags added: unchanged when the user set command buffers or opted out."""
  if environ_opt_out == "0" or "xla_gpu_enable_command_buffer" in xla_flags:
    return xla_flags
  return " ".join([xla_flags.strip(), *GPU_DECODE_FLAGS]).strip()


def apply() -> None:
  """Adds the flags to this process's XLA_FLAGS. A backend already started keeps the flags it started with."""
  os.environ["XLA_FLAGS"] = with_decode_flags(os.environ.get("XLA_FLAGS", ""), os.environ.get(OPT_OUT))
