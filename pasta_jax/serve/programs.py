"""Keeps a long-running server under the kernel's limit on memory maps, which XLA's CPU programs fill.

On CPU every XLA kernel is JIT-compiled into three memory maps of its own (code, constants, data): a Gemma 3 270M
decode program holds ~430 kernels (~1,300 maps), the PASTA one ~900 (~2,700). Linux allows 65,530 maps per
process by default (`vm.max_map_count`), so a server that keeps compiling new shapes (admissions of new prompt
buckets, rows prefixes, four methods) reaches it after a few dozen programs, and then every later compile fails
("LLVM compilation error: Cannot allocate memory") and the server dies. The guard reads the map count every few
seconds and, above a high-water mark, drops every compiled program (`jax.clear_caches`): the next chunks
recompile (slower for a while) instead of failing. Each drop is counted (`pasta_compiled_program_drops_total`)
and logged. Accelerators hold their kernels in device modules, not host maps; the guard costs them nothing.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

MAPS = Path("/proc/self/maps")
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")


def memory_maps() -> tuple[int, int]:
  """(maps this process holds, the kernel's limit); (0, 0) where /proc does not tell."""
  try:
    with MAPS.open("rb") as f:
      used = sum(1 for _ in f)
    return used, int(MAX_MAP_COUNT.read_text())
  except (OSError, ValueError):
    return 0, 0


@dataclasses.dataclass
class ProgramGuard:
  """`check()` drops every compiled program when the process holds more than `high_water` of its allowed maps;
  it reads the count at most every `every_s` seconds."""

  high_water: float = 0.75
  every_s: float = 2.0
  read: Callable[[], tuple[int, int]] = memory_maps
  drop: Callable[[], None] = jax.clear_caches
  on_drop: Callable[[int, int], None] | None = None  # (maps before, limit): metrics and logs
  drops: int = 0
  _next: float = 0.0

  def check(self) -> bool:
    """True when it dropped the compiled programs."""
    now = time.monotonic()
    if now < self._next:
      return False
    self._next = now + self.every_s
    used, limit = self.read()
    if not limit or used <= self.high_water * limit:
      return False
    self.drop()
    self.drops += 1
    if self.on_drop is not None:
      self.on_drop(used, limit)
    return True


def log_drop(used: int, limit: int) -> None:
  print(f"pasta serve: {used} of {limit} memory maps held by compiled programs: dropped them all "
        "(the next chunks recompile; raise vm.max_map_count to keep more)", file=sys.stderr, flush=True)
