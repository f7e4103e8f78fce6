"""The project speaks of itself, not of how it was made: no file name and no line of text in the repository names
a numbered work session or tracker issue. A result says its date, machine and command; a fix says what it fixes.

The words are built from pieces so that this file does not name what it looks for.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SESSION = "sess" + "ion"
ISSUE = "iss" + "ue"
# "<word> 12", "<word>s 24-26", "<word>-23", "<word>_34", "<word>15/", "<word> #15", "the 37th <word>". Letters
# before the word end it (a longer word that ends in it is another word); an underscore or a slash does not.
NUMBERED_HISTORY = re.compile(
    rf"(?<![a-z])(?:{SESSION}|{ISSUE})s?[ _-]?#?\d+"
    rf"|\b\d+(?:st|nd|rd|th)\s+(?:{SESSION}|{ISSUE})s?\b",
    re.IGNORECASE,
)
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".safetensors", ".msgpack", ".gguf", ".npz", ".npy",
                   ".pt", ".bin", ".gz", ".zip", ".tar", ".whl", ".so", ".pyc"}
MAX_TEXT_BYTES = 2 * 2**20


def mentions(name: str, lines) -> list[str]:
  """Every place in a file's name and lines that names numbered history, as 'name: ...' or 'name:N: ...'."""
  found = [f"{name}: its name" for _ in NUMBERED_HISTORY.finditer(name)][:1]
  for number, line in enumerate(lines, 1):
    if NUMBERED_HISTORY.search(line):
      found.append(f"{name}:{number}: {line.strip()[:160]}")
  return found


def _repository_files() -> list[str]:
  """The files a commit of the working tree would hold: tracked and untracked-but-not-ignored ones that exist."""
  if shutil.which("git") is None:
    pytest.skip("git is not installed")
  listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=ROOT, capture_output=True, check=False)
  if listing.returncode != 0:
    pytest.skip("not a git checkout")
  names = sorted({n for n in listing.stdout.decode("utf-8", "replace").split("\0") if n})
  return [n for n in names if (ROOT / n).is_file() and not (ROOT / n).is_symlink()]


def _text_lines(path: Path) -> list[str] | None:
  """A text file's lines; None for a binary file or one over the size limit."""
  if path.suffix.lower() in BINARY_SUFFIXES or path.stat().st_size > MAX_TEXT_BYTES:
    return None
  data = path.read_bytes()
  if b"\0" in data:
    return None
  try:
    return data.decode("utf-8").splitlines()
  except UnicodeDecodeError:
    return None


@pytest.mark.parametrize("text", [
    f"measured in {SESSION} 12",
    f"docs/results/{ISSUE}15/x.txt",
    f"bench_medusa_cpu_{SESSION}24_b1.txt",
    f"the machine of {SESSION}s 24-26",
    f"the {SESSION}-23 heads",
    f"fixed in {ISSUE} #15",
    f"({ISSUE.capitalize()} 16)",
    f"the 37th {SESSION}",
])
def test_numbered_history_is_named(text):
  assert mentions("some/file.md", [text]) == [f"some/file.md:1: {text}"]


@pytest.mark.parametrize("text", [
    f"an HTTP {SESSION}",
    f"the {ISSUE} is that the pool fills",
    f"the {ISSUE}'s budget",
    f"open for the whole {SESSION}, one row a test",
    f"a training {SESSION} of 3 epochs",
    f"ob{SESSION} 2 and t{ISSUE} 3",
])
def test_ordinary_prose_passes(text):
  assert mentions("some/file.md", [text]) == []


def test_a_file_name_is_checked():
  name = f"docs/results/{ISSUE}15/README.md"
  assert mentions(name, ["plain text"]) == [f"{name}: its name"]
  assert mentions("docs/results/learned100_gpubon/README.md", ["plain text"]) == []


def test_a_planted_mention_in_a_file_fails_the_scan(tmp_path):
  planted = tmp_path / "notes.txt"
  planted.write_text(f"first line\nthe step got faster in {SESSION} 9\n")
  assert mentions("notes.txt", _text_lines(planted)) == [f"notes.txt:2: the step got faster in {SESSION} 9"]
  (tmp_path / "image.png").write_bytes(b"\x89PNG\0" + f"{SESSION} 9".encode())
  assert _text_lines(tmp_path / "image.png") is None


def test_no_file_names_numbered_history():
  found = []
  for name in _repository_files():
    lines = _text_lines(ROOT / name)
    found.extend(mentions(name, lines if lines is not None else []))
  files = sorted({f.split(":")[0] for f in found})
  assert not found, (f"{len(found)} mentions of numbered history in {len(files)} files ({', '.join(files)}); "
                     "say the date, machine, command or what the thing does instead:\n" + "\n".join(found[:200]))
