"""Decode one prompt: `python -m infer.generate "..." [--pasta] [...]` is `pasta generate "..." [...]`."""

from __future__ import annotations

import sys

from pasta_jax import cli


def main(argv: list[str] | None = None) -> int:
  return cli.main(["generate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
  sys.exit(main())
