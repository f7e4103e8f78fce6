"""The one tokenizer adapter of decoding: model tokenizers as `lang.tokens.Tokenizer`, chat turns, prompt ids."""

from __future__ import annotations

from collections.abc import Sequence

from pasta_jax.errors import PastaError
from pasta_jax.lang import tokens as tok


class LangTokenizer:
  """The model tokenizer as a `lang.tokens.Tokenizer` (no BOS; tag spellings in text stay text)."""

  def __init__(self, tokenizer):
    self.inner = tokenizer
    self.hf = tok.HFTokenizer(tokenizer.hf) if getattr(tokenizer, "hf", None) is not None else None

  def encode(self, text: str) -> list[int]:
    return self.hf.encode(text) if self.hf else list(self.inner.encode(text, add_bos=False))

  def decode(self, ids: Sequence[int]) -> str:
    return self.hf.decode(ids) if self.hf else self.inner.decode(list(ids))


def chat_text(tokenizer, text: str) -> str:
  if hasattr(tokenizer, "format_chat"):
    return tokenizer.format_chat(text)
  from pasta_jax.model.tokenizer import chat_prompt  # tokenizer-like test doubles
  return chat_prompt(text)


def prompt_ids(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
  if isinstance(prompts, str):
    raise PastaError("prompts must be a list of strings, not one string")
  if not prompts:
    raise PastaError("no prompts given")
  out = []
  for i, text in enumerate(prompts):
    if not text or not text.strip():
      raise PastaError(f"empty prompt (prompt {i}): give some text to continue")
    out.append(tokenizer.encode(chat_text(tokenizer, text) if chat else text, add_bos=True))
  return out
