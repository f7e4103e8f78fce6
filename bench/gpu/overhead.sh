#!/usr/bin/env bash
# On a GPU machine, from the repository root: the decode loop as CUDA graphs (pasta_jax/xla_flags.py, on by
# default) against XLA's own defaults (PASTA_XLA_DEFAULTS=0). First the interpreter == reference tests and the
# tests whose conditionals sit in the loop (certified head, distinct topics) run with the graphs on; then
# bench.seq_cost times plain decoding and the interpreter (1 and 8 lanes, lane buckets on and off) both ways.
# STEP_PROFILE=1 first counts the kernels per step from a profiler trace (profiling runs op by op).
# Each part has its own time limit (TESTS_S, SEQ_S). Logs go under ${OUT:-runs/gpu}.
source bench/gpu/device_info.sh
python3 -c "import pasta_jax, os; print('XLA_FLAGS', os.environ['XLA_FLAGS'])" 2>&1 | tee -a "$out/device.txt"
[ "${STEP_PROFILE:-0}" = 1 ] && timeout 200 python3 -m bench.step_profile --tokens 96 --top 16 2>&1 \
  | tee "$out/step_profile.txt"
timeout "${TESTS_S:-240}" python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_xla_flags.py \
  tests/test_interpreter_vs_reference.py tests/test_certified_head.py tests/test_distinct_topics.py 2>&1 \
  | tail -15 | tee "$out/tests_command_buffers.txt"
seq_cost="python3 -m bench.seq_cost --dtype bfloat16 --tokens 128 --repeats 2 --blocks 1,8 --buckets on,off"
timeout "${SEQ_S:-150}" $seq_cost 2>&1 | tee "$out/seq_cost_command_buffers.txt"
PASTA_XLA_DEFAULTS=0 timeout "${SEQ_S:-150}" $seq_cost 2>&1 | tee "$out/seq_cost_xla_defaults.txt"
