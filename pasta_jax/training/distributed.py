"""Multi-host start: `jax.distributed.initialize()` when the environment says we are one of many hosts."""

from __future__ import annotations

import os

import jax

_MULTI_HOST_HINTS = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")


def is_multi_host_environment() -> bool:
  """TPU pod slices list several worker hostnames; GPU clusters name a coordinator (or run under SLURM)."""
  if any(os.environ.get(k) for k in _MULTI_HOST_HINTS):
    return True
  workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if len([w for w in workers.split(",") if w.strip()]) > 1:
    return True
  return int(os.environ.get("SLURM_NTASKS", "1")) > 1


def maybe_initialize_distributed(force: bool = False) -> None:
  """Call before any other JAX work. On TPU VMs jax discovers peers itself; elsewhere it reads the env."""
  if force or is_multi_host_environment():
    jax.distributed.initialize()


def is_main_process() -> bool:
  return jax.process_index() == 0
