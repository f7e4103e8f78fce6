"""Test marks shared across files."""

import os

import pytest

# Long checks whose ground the default suite already covers more cheaply (tiny models, fewer meshes);
# they run with PASTA_HEAVY_TESTS=1, to keep the suite within CI's time.
HEAVY = pytest.mark.skipif(not os.environ.get("PASTA_HEAVY_TESTS"), reason="set PASTA_HEAVY_TESTS=1 (long)")
