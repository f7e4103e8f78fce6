"""Facts every layer shares, defined once: the interpreter's record columns, the position modes and the
block-length rule (docs/interpreter.md, Position modes; the later paper's section 6.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

# One row per token that becomes pending: (step, lane, thread, token, position).
STEP, LANE, THREAD, TOKEN, POSITION = range(5)
RECORD_COLUMNS = ("step", "lane", "thread", "token", "position")

PositionMode = Literal["pred", "fixed", "oracle"]
POSITION_MODES: tuple[str, ...] = ("pred", "fixed", "oracle")
FIXED_BLOCK_LENGTH = 40  # the "fixed" ablation reserves reserved_span(40) = 42 positions per block

Length = TypeVar("Length")  # an int, or an array of them (the jitted interpreter)


def check_position_mode(mode: str) -> None:
  if mode not in POSITION_MODES:
    raise ValueError(f"unknown position mode {mode!r}; use {', '.join(POSITION_MODES)}")


def block_length(mode: PositionMode, predicted: Callable[[], Length], true_length: Callable[[], Length]) -> Length:
  """The block length main reserves positions for (R = reserved_span of it): the promise's predicted
  length ("pred"), a fixed 40 ("fixed"), or the block's true length ("oracle"). Each length is a thunk,
  read only by its own mode: the true length exists only where a script is known (forced replay)."""
  check_position_mode(mode)
  if mode == "pred":
    return predicted()
  if mode == "fixed":
    return FIXED_BLOCK_LENGTH
  return true_length()
