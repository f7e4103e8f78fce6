"""Our pairwise judging prompt and the parsing of its one-letter reply.

The prompt asks for a single letter so that the first generated token carries the verdict: an
endpoint's first-token logprobs, or a local model's next-token logits, then give a confidence
rather than a hard choice. Bump PROMPT_VERSION whenever the wording changes: it is part of the
judge's name, so cached verdicts from another wording are never reused.
"""

from __future__ import annotations

import re

PROMPT_VERSION = "pairwise-v1"
SYSTEM = ("You are a careful, impartial judge of answers to user instructions. Judge which answer better "
          "follows the instruction: helpful, correct, complete and concise. Ignore the order in which the "
          "answers are shown and their length as such. Reply with one letter: A or B.")
USER = ("Instruction:\n{instruction}\n\n[Answer A]\n{first}\n[End of answer A]\n\n"
        "[Answer B]\n{second}\n[End of answer B]\n\nWhich answer is better? Reply with A or B only.")

_DECORATION = "[]()*\"'`.,:;!-_ \t\n"
_BRACKETED = re.compile(r"\[\[\s*([AB])\s*\]\]", re.I)
_MARKED = re.compile(r"\b(?i:(?:final\s+)?(?:answer|choice|verdict|winner|output)(?:\s+is)?)\s*[:=\-]?\s*"
                     r"[\[(*\"'`]*\s*(?i:answer\s+)?([AB])\b")
_LEADING = re.compile(r"^[\[(*\"'`\s]*([AB])(?:[\])*\"'`.,:;!\s]*$|[\])*\"'`.,:;!]|\s*\n|\s+[-\u2013\u2014]\s)")
_IS_BETTER = re.compile(r"\b(?:answer\s+)?([AB])\s+is\s+(?:the\s+)?(?:better|best|preferred|superior)\b")


def messages(instruction: str, first: str, second: str) -> list[dict]:
  return [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": USER.format(instruction=instruction, first=first, second=second)}]


def local_prompt(instruction: str, first: str, second: str) -> str:
  """The same question as one user turn, for models without a system role (Gemma)."""
  return SYSTEM + "\n\n" + USER.format(instruction=instruction, first=first, second=second)


def parse_choice(text: str) -> str | None:
  """'A', 'B' or None from replies like 'A', '[[B]]', 'Answer: A', 'b.', 'B is better.'.

  Tried from the most to the least explicit form; a form naming both letters is unclear (None),
  and a lone capital "A" starting a sentence ("A good answer...") is not taken for a verdict.
  """
  head = text.strip()[:300]
  if head.strip(_DECORATION).upper() in ("A", "B"):
    return head.strip(_DECORATION).upper()
  for pattern in (_BRACKETED, _MARKED, _LEADING, _IS_BETTER):
    found = {m.group(1).upper() for m in pattern.finditer(head)}
    if found:
      return found.pop() if len(found) == 1 else None
  return None


def letter_of(token: str) -> str | None:
  """The letter a logprob token stands for ('A', ' B', '[[A', '**B'), or None."""
  cleaned = token.strip(_DECORATION)
  return cleaned.upper() if cleaned in ("A", "B", "a", "b") else None
