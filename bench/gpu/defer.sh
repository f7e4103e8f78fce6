#!/usr/bin/env bash
# On a GPU machine, from the repository root (JAX with CUDA; no install of this package needed): what deferring the
# K/V writes past the lane-count switch (model/kv_rows.py, InterpreterConfig.defer_kv_writes) does on the GPU.
# bench.seq_cost for Gemma 3 270M and Gemma 7B shapes (random bf16 weights) with the writes deferred and written
# inside the switch, the kernel tests (the interpreter with the GPU kernel runs the deferred path), and the kernels
# per step. Each part has its own time limit; logs go under ${OUT:-runs/gpu}. Compiling dominates on a fresh machine
# (on an H100: plain decoding plus one interpreter setting of the 270M took about 150 s): give the whole script 15
# minutes, or run its parts in separate calls.
source bench/gpu/device_info.sh
timeout "${SEQ_S:-300}" python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 1 --blocks 1,8 \
  --buckets on --defer off,on 2>&1 | tee "$out/seq_cost_270m.txt"
timeout "${TESTS_S:-130}" python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_thread_attention.py \
  2>&1 | tail -6 | tee "$out/tests.txt"
timeout "${SEQ7B_S:-300}" python3 -m bench.seq_cost --config gemma1-7b --dtype bfloat16 --tokens 64 --repeats 1 \
  --blocks 1,8 --buckets on --defer off,on 2>&1 | tee "$out/seq_cost_7b.txt"
timeout "${PROFILE_S:-80}" python3 -m bench.step_profile --tokens 64 --top 16 2>&1 | tee "$out/step_profile.txt"
