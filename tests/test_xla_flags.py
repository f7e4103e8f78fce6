"""The GPU decode flags: added once, never over a user's own command-buffer setting, opt-out honoured."""

import os
import subprocess
import sys

from pasta_jax import xla_flags


def test_flags_added_to_other_flags():
  out = xla_flags.with_decode_flags(" --xla_backend_optimization_level=0 ")
  assert out.split() == ["--xla_backend_optimization_level=0", *xla_flags.GPU_DECODE_FLAGS]


def test_user_command_buffer_setting_wins_and_adding_is_idempotent():
  mine = "--xla_gpu_enable_command_buffer="
  assert xla_flags.with_decode_flags(mine) == mine
  once = xla_flags.with_decode_flags("")
  assert xla_flags.with_decode_flags(once) == once


def test_opt_out_keeps_xla_defaults():
  assert xla_flags.with_decode_flags("--a=1", environ_opt_out="0") == "--a=1"
  assert xla_flags.with_decode_flags("--a=1", environ_opt_out="1") != "--a=1"


def test_importing_the_package_sets_the_flags_before_jax_starts():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_flags.OPT_OUT)}
  code = "import os, pasta_jax, jax; jax.numpy.ones(1).block_until_ready(); print(os.environ['XLA_FLAGS'])"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
  assert out.split() == list(xla_flags.GPU_DECODE_FLAGS)
