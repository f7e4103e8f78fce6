"""A thin wrapper over a Hugging Face tokenizer: the few operations the project needs, explicit BOS.

Loadable from an HF folder (AutoTokenizer) or a GGUF file (transformers rebuilds the tokenizer from
the vocabulary in the file's metadata). BOS is added by us, never by the HF call, so every caller
gets the same ids whatever the tokenizer's own `add_bos_token` says.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pasta_jax.errors import WeightsError

log = logging.getLogger(__name__)

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def chat_prompt(prompt: str) -> str:
  """One user turn in Gemma's chat format, opening the model's turn (BOS not included)."""
  return f"{START_OF_TURN}user\n{prompt}{END_OF_TURN}\n{START_OF_TURN}model\n"


def has_tokenizer_files(folder: str | os.PathLike) -> bool:
  return any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES)


class Tokenizer:
  """Encode / decode / id lookup; `source` says where it was loaded from (stored in checkpoints)."""

  def __init__(self, hf_tokenizer: Any, source: str):
    self.hf = hf_tokenizer
    self.source = source

  # --- loading --------------------------------------------------------------------------------------
  @classmethod
  def from_hf(cls, folder: str | os.PathLike) -> Tokenizer:
    from transformers import AutoTokenizer
    folder = Path(folder)
    if not has_tokenizer_files(folder):
      raise WeightsError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {folder}")
    try:
      return cls(AutoTokenizer.from_pretrained(str(folder)), str(folder))
    except Exception as e:  # transformers raises many types for broken files
      raise WeightsError(f"cannot load the tokenizer in {folder}: {_one_line(e)}") from None

  @classmethod
  def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None | bool = None) -> Tokenizer:
    """The tokenizer described by a GGUF's metadata (tokens, scores, special ids).

    Building it takes seconds for a 262k vocabulary, so the result is saved as HF tokenizer files
    in the GGUF cache (see `gguf_loader.default_cache_dir`; cache_dir=False: off) and reloaded
    from there, keyed like the params by the file's size and mtime and by the transformers version.
    """
    path = Path(path)
    if not path.is_file():
      raise WeightsError(f"no such GGUF file: {path}")
    stat = path.stat()
    # Reloading from the files still takes seconds; a process that loads the model twice (a tuned
    # model over its base, eval's models) shares one: the wrapper never changes the HF tokenizer.
    return cls._from_gguf_cached(path.resolve(), stat.st_size, stat.st_mtime_ns, cache_dir)

  @classmethod
  @functools.lru_cache(maxsize=4)
  def _from_gguf_cached(cls, path: Path, size: int, mtime_ns: int, cache_dir) -> Tokenizer:
    from importlib.metadata import version

    from pasta_jax.model import gguf_loader
    cached = None
    if cache_dir is not False:
      root = Path(cache_dir) if cache_dir else gguf_loader.default_cache_dir(path)
      cached = root / f"{gguf_loader.cache_key(path)}-v1-tokenizer-{version('transformers')}"
      if (cached / "tokenizer.json").is_file():
        try:
          return cls(_load_fast(cached), str(path))
        except Exception:  # a torn cache entry: rebuild below
          pass
    import transformers

    arch = gguf_loader.read_gguf(path).metadata.get("general.architecture", "")  # also validates the file
    try:
      # The Gemma class reads the vocabulary directly (~5 s for 262k tokens); AutoTokenizer would
      # first parse the whole file with gguf's slow reader to find the class (~30 s).
      # GemmaTokenizerFast: the tokenizers-backed class in 4.x; an alias of GemmaTokenizer in 5.x.
      gemma = getattr(transformers, "GemmaTokenizerFast", None) or transformers.GemmaTokenizer
      kind = gemma if str(arch).startswith("gemma") else transformers.AutoTokenizer
      hf = kind.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
      raise WeightsError(f"cannot build a tokenizer from GGUF {path}: {_one_line(e)}") from None
    _check_whole_words(hf, path)
    if cached is not None:
      _save_atomically(hf, cached)
      _remove_stale(cached, path.stem)
      return cls(_load_fast(cached), str(path))  # what every later process loads: the same class each time
    return cls(hf, str(path))

  @classmethod
  def load(cls, path: str | os.PathLike) -> Tokenizer:
    """From a .gguf file or a folder with HF tokenizer files."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
      return cls.from_gguf(path)
    if path.is_dir():
      return cls.from_hf(path)
    raise WeightsError(f"no tokenizer at {path} (expected a .gguf file or an HF tokenizer folder)")

  def save(self, folder: str | os.PathLike) -> Path:
    """Write HF tokenizer files (tokenizer.json, tokenizer_config.json) so `from_hf` reloads them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    self.hf.save_pretrained(str(folder))
    return folder

  # --- ids --------------------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return len(self.hf)

  @property
  def bos_id(self) -> int | None:
    return self.hf.bos_token_id

  @property
  def pad_id(self) -> int:
    pad = self.hf.pad_token_id
    return 0 if pad is None else pad

  @functools.cached_property
  def eos_ids(self) -> tuple[int, ...]:
    """Ids that end generation: EOS, plus `<end_of_turn>` where the vocabulary has it."""
    ids = [self.hf.eos_token_id, self.token_to_id(END_OF_TURN)]
    return tuple(dict.fromkeys(i for i in ids if i is not None))

  def token_to_id(self, token: str) -> int | None:
    """Id of an exact vocabulary entry, or None (never the unknown token's id)."""
    backend = getattr(self.hf, "backend_tokenizer", None)
    if backend is not None:
      return backend.token_to_id(token)
    return self._vocab.get(token)

  @functools.cached_property
  def _vocab(self) -> dict[str, int]:
    return self.hf.get_vocab()

  def id_to_token(self, token_id: int) -> str:
    return self.hf.convert_ids_to_tokens(int(token_id))

  # --- text -------------------------------------------------------------------------------------------
  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    ids = self.hf.encode(text, add_special_tokens=False)
    if add_bos and self.bos_id is not None:
      ids = [self.bos_id, *ids]
    return list(ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens,
                          clean_up_tokenization_spaces=False)

  def format_chat(self, prompt: str) -> str:
    return chat_prompt(prompt)

  def encode_chat(self, prompt: str, add_bos: bool = True) -> list[int]:
    """BOS + one user turn + the opening of the model's turn, as Gemma's chat template writes it."""
    return self.encode(chat_prompt(prompt), add_bos=add_bos)

  def tag_vocab(self, length_step: int = 10):
    """PASTA-LANG tag ids on this vocabulary's `<unused*>` tokens, with its end-of-thread ids
    (length_step 1: one LENGTH token per exact block length, for the Pred-1x position mode)."""
    from pasta_jax.lang.tags import TagVocab
    return TagVocab.from_token_lookup(self.token_to_id, self.eos_ids, length_step)

  def __repr__(self) -> str:
    return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


def _load_fast(folder: Path) -> BackendTokenizer:
  """The saved tokenizer straight from its tokenizer.json (1-2 s for Gemma's 262k vocabulary), not through
  AutoTokenizer: transformers 5's GemmaTokenizer rebuilds the vocabulary on load (12 s). Same ids, same text
  (tests/test_weights.py compares them); the special tokens come from its tokenizer_config.json."""
  config = json.loads((folder / "tokenizer_config.json").read_text())
  specials = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
  return BackendTokenizer(folder / "tokenizer.json", specials)


class BackendTokenizer:
  """The calls this project makes of a Hugging Face fast tokenizer, answered by its `tokenizers` backend alone.

  A fast tokenizer's answers to these calls are its backend's (transformers' PreTrainedTokenizerFast passes them
  through); loading the backend without transformers saves importing it (0.6 s) and its wrapper's set-up (0.3 s) in
  every command that decodes."""

  def __init__(self, tokenizer_file: Path, specials: dict[str, str]):
    import tokenizers

    self.backend_tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    self._file = Path(tokenizer_file)
    self.specials = specials  # bos_token, eos_token, pad_token, ...: the token strings
    self._encoding = threading.Lock()

  def _special_id(self, name: str) -> int | None:
    token = self.specials.get(name)
    return None if token is None else self.backend_tokenizer.token_to_id(token)

  @property
  def bos_token_id(self) -> int | None:
    return self._special_id("bos_token")

  @property
  def eos_token_id(self) -> int | None:
    return self._special_id("eos_token")

  @property
  def pad_token_id(self) -> int | None:
    return self._special_id("pad_token")

  def __len__(self) -> int:
    return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

  def get_vocab(self) -> dict[str, int]:
    return self.backend_tokenizer.get_vocab(with_added_tokens=True)

  def convert_ids_to_tokens(self, token_id: int) -> str | None:
    return self.backend_tokenizer.id_to_token(int(token_id))

  def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
    """split_special_tokens: special-token spellings in `text` are read as plain text, not as the special ids."""
    backend = self.backend_tokenizer
    with self._encoding:  # the setting is the backend's, not the call's: one call at a time (the server's threads)
      backend.encode_special_tokens = split_special_tokens
      try:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
      finally:
        backend.encode_special_tokens = False

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
             clean_up_tokenization_spaces: bool = False) -> str:
    if clean_up_tokenization_spaces:
      raise ValueError("clean_up_tokenization_spaces is not supported: it corrupts BPE text")
    return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def save_pretrained(self, folder: str) -> None:
    """The files it was loaded from, as `Tokenizer.from_hf` reads them."""
    folder = Path(folder)
    shutil.copyfile(self._file, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({**self.specials, "tokenizer_class":
                                                              "PreTrainedTokenizerFast"}, indent=1))


def _check_whole_words(hf_tokenizer, path: Path, probes: int = 32) -> None:
  """Refuses a GGUF tokenizer that splits its own whole-word pieces apart.

  transformers 5.17.0 builds Gemma 3's GGUF tokenizer without its merges:
  ' world' becomes '▁w', 'or', 'ld' instead of '▁world'. The model would then read text in
  pieces it never saw, silently. The probes are the first word pieces of the vocabulary ('▁the',
  '▁and', ...); a sound tokenizer keeps nearly all of them whole.
  """
  import transformers

  vocab = hf_tokenizer.get_vocab()
  words = sorted((i, p) for p, i in vocab.items()
                 if p.startswith("\u2581") and p[1:].isascii() and p[1:].isalpha() and len(p) >= 4)[:probes]
  split = [p for _, p in words if len(hf_tokenizer.encode(" " + p[1:], add_special_tokens=False)) != 1]
  if len(split) * 2 > len(words):
    raise WeightsError(
        f"the tokenizer transformers {transformers.__version__} built from GGUF {path} splits {len(split)} of "
        f"{len(words)} whole-word pieces of its own vocabulary (e.g. {split[0]!r}): its GGUF tokenizer conversion "
        "is broken for this model; install another transformers version (5.18 to 5.23 build it correctly)")


def _save_atomically(hf_tokenizer, folder: Path) -> None:
  """save_pretrained into a temporary sibling, then rename: readers never see half a folder."""
  tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
  try:
    folder.parent.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, folder)
  except OSError as e:  # read-only or full disk: the cache is an optimisation only
    log.warning("could not cache the tokenizer in %s: %s", folder, e)
    shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(current: Path, stem: str) -> None:
  """Drop tokenizers cached for older versions of the same GGUF (or other transformers versions)."""
  for other in current.parent.glob(f"{glob.escape(stem)}-*-tokenizer-*"):
    in_progress = ".tmp" in other.name  # another process's save, about to be renamed
    if other != current and not in_progress and other.name.split("-tokenizer-")[0].rsplit("-", 3)[0] == stem:
      shutil.rmtree(other, ignore_errors=True)


def _one_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"
