#!/usr/bin/env bash
# On a GPU machine, from the repository root (JAX with CUDA installed; no install of this package needed):
# the thread-metadata kernel compiled for real against XLA (tests), then bench.attention for Gemma 3 270M's and
# Gemma 7B's head layouts, and the interpreter's per-step cost. Writes logs under ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/device.txt"
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_thread_attention.py 2>&1 | tee "$out/tests.txt"
python3 -m bench.attention --runs 5 2>&1 | tee "$out/attention_270m.txt"
python3 -m bench.attention --runs 5 --heads 16,16 --slots 1024,4096,32768 2>&1 | tee "$out/attention_7b.txt"
python3 -m bench.seq_cost --dtype bfloat16 --blocks 1,8 2>&1 | tee "$out/seq_cost_270m.txt"
