# Sourced by the bench/gpu scripts, from the repository root: strict mode, the log folder $out (${OUT:-runs/gpu}),
# PYTHONPATH for running without an install, and the GPU, driver and JAX version into $out/device.txt.
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$out/device.txt"
