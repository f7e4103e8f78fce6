"""Test-wide settings.

fp32 matmuls run at full precision: on GPUs XLA would otherwise use TF32 for fp32 (about 1e-3
relative error), and the parity tests (training forward == decode replay, ours == transformers)
compare fp32 logits to 1e-4. On CPU this changes nothing.
"""

import os

# The suite is bound by XLA compile time (hundreds of small loops, each run a few times): LLVM's
# optimization level 0 compiles them about twice as fast. It changes no semantics (XLA's own HLO
# passes still run, no fast-math); the benches and `pasta` commands keep the default level. Must be
# set before the first computation initializes the backend; a user's own XLA_FLAGS are kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# The output head's form per row count is measured per process on a CPU (model/head_plan.py); the suite pins the
# fixed plan so every worker runs the same forms, and the certified tests reach the narrow head at 2+ rows.
# tests/test_head_plan.py measures it explicitly.
os.environ.setdefault("PASTA_HEAD_PLAN", "fixed")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
