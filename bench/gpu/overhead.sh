#!/usr/bin/env bash
# On a GPU machine, from the repository root: where the interpreter's step goes (kernels per step from a profiler
# trace) and whether XLA's command buffers (CUDA graphs over the decode loop's body) cut the launch-bound step.
# Each bench prints only when it ends: give each one its own time limit. Writes logs under ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
timeout 200 python3 -m bench.step_profile --tokens 96 --top 16 2>&1 | tee "$out/step_profile.txt"
timeout 150 python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1 --buckets on 2>&1 \
  | tee "$out/seq_cost_default.txt"
XLA_FLAGS="$graphs" timeout 150 python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1 \
  --buckets on 2>&1 | tee "$out/seq_cost_command_buffers.txt"
