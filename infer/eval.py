"""Speed and quality of decoding methods: `python -m infer.eval --out DIR [...]` is `pasta eval --out DIR [...]`."""

from __future__ import annotations

import sys

from pasta_jax import cli


def main(argv: list[str] | None = None) -> int:
  return cli.main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
  sys.exit(main())
