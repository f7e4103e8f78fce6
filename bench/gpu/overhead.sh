#!/usr/bin/env bash
# On a GPU machine, from the repository root: whether XLA's command buffers (CUDA graphs, here over the decode
# loop's while body and its conditionals too) cut the launch-bound step of the 270M, for plain decoding and for the
# interpreter (1 and 8 lanes, lane buckets on and off). STEP_PROFILE=1 first counts the kernels per step from a
# profiler trace. Each bench prints only when it ends: each has its own time limit. Logs go under ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$out/device.txt"
[ "${STEP_PROFILE:-0}" = 1 ] && timeout 200 python3 -m bench.step_profile --tokens 96 --top 16 2>&1 \
  | tee "$out/step_profile.txt"
seq_cost="python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1,8 --buckets on,off"
timeout "${SEQ_S:-220}" $seq_cost 2>&1 | tee "$out/seq_cost_default.txt"
XLA_FLAGS="$graphs" timeout "${SEQ_S:-220}" $seq_cost 2>&1 | tee "$out/seq_cost_command_buffers.txt"
