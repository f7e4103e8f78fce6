"""Test-wide settings.

fp32 matmuls run at full precision: on GPUs XLA would otherwise use TF32 for fp32 (about 1e-3
relative error), and the parity tests (training forward == decode replay, ours == transformers)
compare fp32 logits to 1e-4. On CPU this changes nothing.
"""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
