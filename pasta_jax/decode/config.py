"""The static configuration of one compiled interpreter: shapes, sampling, and the method's rules."""

from __future__ import annotations

import dataclasses

from pasta_jax.decode.rules.base import Rules
from pasta_jax.decode.rules.pasta import PastaRules
from pasta_jax.decode.sampling import SamplingConfig
from pasta_jax.decode.sharding import DecodeSharding
from pasta_jax.lang import schema
from pasta_jax.lang.tags import TagVocab
from pasta_jax.model.head_plan import FIXED as FIXED_HEAD_PLAN
from pasta_jax.model.head_plan import HeadPlan


@dataclasses.dataclass(frozen=True)
class InterpreterConfig:
  """Static shape and behaviour of one compiled interpreter (a jit static argument)."""

  vocab: TagVocab
  lanes: int = 8  # T: lane 0 is main
  max_threads: int = 64  # U: thread ids per request (main + forks)
  pool_slots: int = 1024  # S: prompt + everything written
  max_steps: int = 1024
  max_content: int = 0  # content-token budget per request (0: none); reaching it cuts the request ("tokens")
  sampling: SamplingConfig = SamplingConfig()
  position_mode: schema.PositionMode = "pred"
  record_logits: bool = False  # keep each record's logits (parity checks against other implementations)
  lane_buckets: bool = True  # compute only as many query rows as lanes feed (1, 2, 4, ...)
  rules: Rules = PastaRules()  # the method: PastaRules, AparRules, SotRules, SequentialRules (decode/rules/)
  sharding: DecodeSharding | None = None  # decode under a mesh (decode/sharding.py); None: one device
  # The step multiplies the output head itself (decode/certified_head.py): greedy choices certified against
  # the float32 head, at the narrow head's cost; final_softcap: the model's final logit softcap, applied there.
  certify_head: bool = False
  final_softcap: float | None = None
  head_plan: HeadPlan = FIXED_HEAD_PLAN  # the head's form per row count, as the model's (api.head_plan)
  # Under the lane-count switch the model only reads the pool and the step writes the new K/V rows after it
  # (model/kv_rows.py): written inside a branch, XLA:CPU copies the pool in and out each step. False: the model
  # writes in the branch. None: the backend's choice (`kv_rows.defer_by_default`: deferred on a CPU only, where
  # it pays; on an H100 writing in the branch is faster). bench.kv_writes and bench.seq_cost --defer measure both.
  defer_kv_writes: bool | None = None

  def __post_init__(self):
    if self.max_content < 0:
      raise ValueError(f"max_content must be >= 0 (0: no content budget), got {self.max_content}")
    if self.lanes < 1 or self.max_threads < 1 or self.pool_slots < 1:
      raise ValueError(f"lanes, max_threads and pool_slots must be positive: {self}")
    if not isinstance(self.rules, Rules):
      raise ValueError(f"rules must be a decode.rules object (PastaRules(), AparRules(), ...), got {self.rules!r}")
    self.rules.validate(self)
    if self.certify_head and (not self.sampling.greedy or self.record_logits):
      raise ValueError("certify_head certifies greedy choices: it needs temperature 0 and no recorded logits "
                       "(the other logits are bounds, not values)")
    schema.check_position_mode(self.position_mode)
    if self.position_mode == "pred-1x" and self.vocab.length_step != 1:
      raise ValueError("position_mode='pred-1x' reads exact lengths from the tags: it needs a tag vocabulary "
                       "with one LENGTH token per length (tokenizer.tag_vocab(length_step=1))")

  @property
  def max_records(self) -> int:
    return self.rules.max_records(self)
