"""Serve a model over HTTP: `python -m infer.serve [--model M] [--port 8000] [...]` is `pasta serve [...]`: an
OpenAI-style API with streaming, a page of the threads at `/`, health and metrics (docs/serving.md)."""

from __future__ import annotations

import sys

from pasta_jax import cli


def main(argv: list[str] | None = None) -> int:
  return cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
  sys.exit(main())
