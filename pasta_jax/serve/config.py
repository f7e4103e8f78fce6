"""`pasta serve`'s engine configuration: fixed shapes and limits chosen at start-up."""

from __future__ import annotations

import dataclasses

from pasta_jax.baselines.sot import SotConfig
from pasta_jax.methods import Method


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Fixed shapes and limits chosen at start-up."""

  batch: int = 8  # rows per method batch
  pool_slots: int = 1024  # KV slots per row (prompt + answer, tags included)
  chunk_steps: int = 8  # steps per device call between host visits
  # after an admission, the batch's next chunk: newcomers' first text streams after this many steps, not K
  # (the last token is held back one chunk, `streaming`), at the cost of one more host visit
  first_chunk_steps: int = 2
  # a chunk's steps are at most chunk_seconds / the batch's measured step time (at least 1); 0: chunk_steps always
  chunk_seconds: float = 0.5
  # a burst of requests is admitted in one prefill: before admitting, the engine waits until no request has arrived
  # for admit_quiet_s, at most admit_wait_s after the oldest waiting one arrived (a prefill costs its padded group's
  # rows, so a burst admitted in two parts pays about twice; a request that waited through a chunk waits no more)
  admit_quiet_s: float = 0.02
  admit_wait_s: float = 0.25
  max_queue: int = 64  # waiting requests before 429
  max_tokens: int = 512  # the largest max_tokens a request may ask
  default_max_tokens: int | None = None  # for a request without max_tokens (None: min(256, max_tokens))
  max_batches: int = 8  # batches held at once (one per served method, two with a certified head: `BatchKey`)
  dtype: str = "float32"
  # the served methods' options (a method not here is served with its defaults): e.g. `Pasta(lanes=4)`,
  # `Medusa(heads=folder)`, `Superposed(drafts=3)` (a request's `n` takes its best n drafts)
  methods: tuple[Method, ...] = ()
  propd_samples: int = 2  # ProPD: timed chunks per tree size and rows bucket before T(s) is fitted (`serve/propd.py`)
  sot: SotConfig = SotConfig()  # SoT's stages (its point and answer budgets are each request's max_tokens)
  sot_script_tokens: int = 128  # the longest point prompt a SoT row takes (longer: answered plainly)
  # Greedy batches choose from a bfloat16 copy of the head, certified against the float32 one (the same tokens;
  # `decode/certified_head.py`); sampled requests and Superposed Decoding read logit values and keep float32.
  certify_head: bool = False
  # the watchdog: rows to run (or requests waiting) and no turn of the engine finished for this long (a first
  # compile on a CPU takes up to a minute): /health says "stalled"
  stall_s: float = 300.0
  # failures of the engine's own loop (outside a batch) in a row before it gives up; each one fails every request
  # in flight and starts the loop afresh (a batch's failure fails that batch's requests only)
  max_restarts: int = 5

  def __post_init__(self):
    if self.default_max_tokens is None:
      object.__setattr__(self, "default_max_tokens", min(256, self.max_tokens))
    if not self.stall_s > 0:
      raise ValueError(f"stall_s must be positive, got {self.stall_s}")
    for name in ("chunk_seconds", "admit_quiet_s", "admit_wait_s"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
    for name in ("batch", "pool_slots", "chunk_steps", "first_chunk_steps", "max_queue", "max_tokens",
                 "default_max_tokens", "max_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
    if self.default_max_tokens > self.max_tokens:
      raise ValueError(f"default_max_tokens {self.default_max_tokens} > max_tokens {self.max_tokens}")
    named = [m.name for m in self.methods]
    if len(set(named)) < len(named) or not all(isinstance(m, Method) and m.capabilities.serve for m in self.methods):
      raise ValueError(f"methods: one served method value per name, got {self.methods!r}")
    if self.certify_head and self.dtype != "float32":
      raise ValueError(f"certify_head certifies a float32 model's head, not a {self.dtype} one")
