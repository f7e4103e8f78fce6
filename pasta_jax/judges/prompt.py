"""Our pairwise judging prompt and the parsing of its one-letter reply."""

from __future__ import annotations

import re

PROMPT_VERSION = "pairwise-v1"
SYSTEM = ("You are a careful, impartial judge of answers to user instructions. Judge which answer better "
          "follows the instruction: helpful, correct, complete and concise. Ignore the order in which the "
          "answers are shown and their length as such. Reply with one letter: A or B.")
USER = ("Instruction:\n{instruction}\n\n[Answer A]\n{first}\n[End of answer A]\n\n"
        "[Answer B]\n{second}\n[End of answer B]\n\nWhich answer is better? Reply with A or B only.")
_CHOICE = re.compile(r"(?:\[\[\s*([AB])\s*\]\]|\b(?:answer|choice|verdict)?\s*:?\s*\b([AB])\b)", re.I)


def messages(instruction: str, first: str, second: str) -> list[dict]:
  return [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": USER.format(instruction=instruction, first=first, second=second)}]


def local_prompt(instruction: str, first: str, second: str) -> str:
  """The same question as one user turn, for models without a system role (Gemma)."""
  return SYSTEM + "\n\n" + USER.format(instruction=instruction, first=first, second=second)


def parse_choice(text: str) -> str | None:
  """'A', 'B' or None from replies like 'A', '[[B]]', 'Answer: A', 'b.'; None if unclear or both."""
  found = {(m.group(1) or m.group(2)).upper() for m in _CHOICE.finditer(text.strip()[:200])}
  return found.pop() if len(found) == 1 else None


def letter_of(token: str) -> str | None:
  """The letter a logprob token stands for ('A', ' B', '[[A', ...), or None."""
  cleaned = token.strip().strip("[]()*\"'.: ").upper()
  return cleaned if cleaned in ("A", "B") else None
