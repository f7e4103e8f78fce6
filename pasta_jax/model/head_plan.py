"""How the decode step multiplies the output head at each row count: measured on this machine, not assumed.

The tied head (262k x 640 on Gemma 3 270M) is most of a CPU decode step, and which matmul form reads it fastest
for 2-8 rows depends on the machine: on one CPU the token-major float32 form cost 31 ms at 2 rows against
37 ms weight-major; on a 2-core AMD EPYC (AVX2) it cost 63 ms against 36, and there from 4 rows on the
bfloat16 copy (38-56 ms) was slower than the float32 head read weight-major (34-44 ms). So on a CPU
`model/head_timing.py` times the forms once per process, on the head's real shape, `choose` makes the plan, and
the decoders compile it (a static field of `Gemma` and of the interpreter's config). Elsewhere, or with
`PASTA_HEAD_PLAN=fixed`, the fixed plan below (that first CPU's) holds.

Every form computes the same function up to float32 rounding (`tests/test_head_plan.py`).
"""

from __future__ import annotations

import dataclasses

MARGIN = 0.9  # a form replaces the fixed plan's (or the float32 head) only when it takes under this share of its time


@dataclasses.dataclass(frozen=True)
class HeadPlan:
  """Per row count (B * Q), the form of the decode layout's output head.

  token_major: rows at which the full-precision head multiplies token-major ([B, Q, D] x [V, D] -> [B, Q, V]);
  other rows multiply weight-major (one row: XLA:CPU's gemv).
  exact: rows at which a certified head (`decode.certified_head`) takes the float32 head directly, because its
  narrow copy is no faster there: one row always (the gemv reads float32 as fast).
  """

  token_major: tuple[int, ...] = (2, 3)
  exact: tuple[int, ...] = (1,)
  # (("rows:form", ms), ...) behind the choice: neither compared nor in the repr, which names compiled programs
  measured: tuple = dataclasses.field(default=(), compare=False, repr=False)

  def exact_at(self, rows: int) -> bool:
    """Whether a certified head takes the float32 head at `rows` (B * Q): at the rows of `exact`, and at a row count
    above every measured one when the largest measured went exact (a narrow product's lead shrinks with rows: the
    int8 one costs 56 ms at 8 rows against 44 float32 on a 2-core EPYC, so a batch of 16 or a tree of 32 rows
    must not take it unmeasured)."""
    measured = {int(key.split(":")[0]) for key, _ in self.measured}
    return rows in self.exact or (bool(measured) and rows > max(measured) and max(measured) in self.exact)


FIXED = HeadPlan()


def describe(plan: HeadPlan, narrow: bool) -> str:
  """One line for logs and reports: what this machine's plan multiplies at each row count, and the timings behind
  it. narrow: a certified head's plan (where `exact` says the certificate is skipped)."""
  timed = ", ".join(f"{key} {ms:g} ms" for key, ms in plan.measured) or "none (the fixed plan)"
  beyond = " and above" if plan.exact and plan.exact_at(max(plan.exact) + 1) else ""
  exact = f"float32 head, no certificate, at rows {_rows(plan.exact)}{beyond}; " if narrow else ""
  return f"head plan: {exact}token-major at rows {_rows(plan.token_major)}; timed: {timed}"


def _rows(counts: tuple[int, ...]) -> str:
  return ", ".join(map(str, counts)) or "none"


def choose(timings: dict[tuple[int, str], float], narrow: bool) -> HeadPlan:
  """The plan from timings {(rows, form): seconds}, form in "weight_major", "token_major", "narrow" (the narrow
  copy as `gemma.output_head` multiplies it). At each measured row count the fixed plan's form is kept unless the
  other is faster by the MARGIN; the certified head goes exact unless the narrow product is faster by the MARGIN
  (the certificate adds its own work, the bound and the candidates' exact logits, and sometimes a float32 pass)."""
  token_major, exact = set(FIXED.token_major), set(FIXED.exact)
  for rows in sorted({r for r, _ in timings}):
    wm, tm = timings[(rows, "weight_major")], timings[(rows, "token_major")]
    fixed_tm = rows in FIXED.token_major
    kept, other = (tm, wm) if fixed_tm else (wm, tm)
    if other < MARGIN * kept:
      token_major ^= {rows}
    if narrow and timings[(rows, "narrow")] >= MARGIN * min(wm, tm):
      exact.add(rows)
  ms = tuple((f"{rows}:{form}", round(1e3 * s, 2)) for (rows, form), s in sorted(timings.items()))
  return HeadPlan(tuple(sorted(token_major)), tuple(sorted(exact)), ms)
