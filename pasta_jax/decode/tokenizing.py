"""The one tokenizer adapter of decoding: model tokenizers as `lang.tokens.Tokenizer`, chat turns, prompt ids."""

from __future__ import annotations

from collections.abc import Sequence

from pasta_jax.errors import PastaError


class LangTokenizer:
  """A model tokenizer (`model.tokenizer.Tokenizer`, a test double) or a Hugging Face tokenizer as a
  `lang.tokens.Tokenizer`: no BOS, and special-token spellings in text (`<unused0>`, tag-like text)
  stay text, split into ordinary tokens."""

  def __init__(self, tokenizer):
    self.inner = tokenizer
    is_hf = hasattr(tokenizer, "convert_tokens_to_ids")
    self.hf = tokenizer if is_hf else getattr(tokenizer, "hf", None)

  def encode(self, text: str) -> list[int]:
    if self.hf is not None:
      return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))
    return list(self.inner.encode(text, add_bos=False))

  def decode(self, ids: Sequence[int]) -> str:
    if self.hf is not None:
      return self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return self.inner.decode(list(ids))


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
