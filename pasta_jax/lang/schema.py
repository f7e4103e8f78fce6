"""Facts every layer shares, defined once: the interpreter's record columns, the position modes and the
block-length rule (docs/interpreter.md, Position modes; the later paper's section 6.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

# One row per token that becomes pending: (step, lane, thread, token, position).
STEP, LANE, THREAD, TOKEN, POSITION = range(5)
RECORD_COLUMNS = ("step", "lane", "thread", "token", "position")

# The later paper's position ablations (section 6.2): what R (the positions main reserves for a block)
# comes from, and what the promise's LENGTH token says.
#   pred            Pred-10x: the predicted length, in 10-token buckets (the paper's choice, the default)
#   pred-1x         Pred-1x: the predicted exact length (a tag vocabulary with one token per length)
#   fixed           Fixed-length: 40 for every block
#   oracle          Oracle-1x: the block's true length
#   oracle-10x      Oracle-10x: the true length rounded to the nearest multiple of 10
#   oracle-tagless  Oracle: the true length, and the promise's tag carries no length
# The oracle modes need every block's true length, which only forced replay (or training) knows.
PositionMode = Literal["pred", "pred-1x", "fixed", "oracle", "oracle-10x", "oracle-tagless"]
POSITION_MODES: tuple[str, ...] = ("pred", "pred-1x", "fixed", "oracle", "oracle-10x", "oracle-tagless")
ORACLE_MODES: tuple[str, ...] = ("oracle", "oracle-10x", "oracle-tagless")
FIXED_BLOCK_LENGTH = 40  # the "fixed" ablation reserves reserved_span(40) = 42 positions per block
ORACLE_STEP, MAX_ORACLE = 10, 500  # Oracle-10x rounds like the tags' buckets: [10, 500]

Length = TypeVar("Length")  # an int, or an array of them (the jitted interpreter)


def check_position_mode(mode: str) -> None:
  if mode not in POSITION_MODES:
    raise ValueError(f"unknown position mode {mode!r}; use {', '.join(POSITION_MODES)}")


def length_step(mode: PositionMode) -> int:
  """The tag vocabulary's length granularity a mode trains and decodes with: 1 for Pred-1x, else 10."""
  check_position_mode(mode)
  return 1 if mode == "pred-1x" else 10


def block_length(mode: PositionMode, predicted: Callable[[], Length], true_length: Callable[[], Length]) -> Length:
  """The block length main reserves positions for (R = reserved_span of it), per mode (above): the
  promise's predicted length, a fixed 40, or the block's true length (rounded for Oracle-10x). Each
  length is a thunk, read only by its own mode: the true length exists only where a script is known."""
  check_position_mode(mode)
  if mode in ("pred", "pred-1x"):
    return predicted()
  if mode == "fixed":
    return FIXED_BLOCK_LENGTH
  if mode == "oracle-10x":
    return round_to_ten(true_length())
  return true_length()


def round_to_ten(length: Length) -> Length:
  """Nearest multiple of 10 (halves up), clamped to [10, 500]: an int, or an int array under jit."""
  rounded = (length + ORACLE_STEP // 2) // ORACLE_STEP * ORACLE_STEP
  if isinstance(rounded, int):
    return min(MAX_ORACLE, max(ORACLE_STEP, rounded))
  return rounded.clip(ORACLE_STEP, MAX_ORACLE)
